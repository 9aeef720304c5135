"""The seed's converter module, at its documented name; the code lives in tp_llama.parallel.converter."""

from tp_llama.parallel.converter import (
    _all_gather_into_list,
    _is_tp_sharded,
    _unshard_param,
    _verify_fqn_across_ranks,
    build_distributed_state_dict_from_consolidated,
)

__all__ = [
    "_all_gather_into_list",
    "_is_tp_sharded",
    "_unshard_param",
    "_verify_fqn_across_ranks",
    "build_distributed_state_dict_from_consolidated",
]
