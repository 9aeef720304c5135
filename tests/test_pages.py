"""tp_llama.pages: memory for the streamed weights on 2 MiB pages."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from tp_llama.pages import HUGE_PAGE, huge_empty, huge_page_bytes

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The bracketed word of the THP setting ("always", "madvise", "never"), None where absent."""
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")]


def test_big_tensors_start_on_a_huge_page_and_keep_their_memory():
    t = huge_empty((3, HUGE_PAGE // 4 + 5), torch.float32)  # not a whole number of pages
    assert t.shape == (3, HUGE_PAGE // 4 + 5) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    gc.collect()  # the mapping must live as long as the tensor, not as long as huge_empty's locals
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).view_as(t))
    assert t[2, -1].item() == t.numel() - 1
    view = t[1:]
    del t
    gc.collect()
    assert view[1, -1].item() == view.numel() + view.shape[1] - 1


def test_small_tensors_are_ordinary():
    t = huge_empty((16, 16), torch.bfloat16)
    assert t.shape == (16, 16) and t.dtype == torch.bfloat16


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"),
                    reason=f"transparent huge pages are {thp_mode()!r} here: Linux gives no 2 MiB pages")
def test_linux_gives_2_mib_pages():
    before = huge_page_bytes()
    assert before is not None
    pages = 8
    t = huge_empty((pages * HUGE_PAGE,), torch.uint8)
    t.fill_(1)  # first touch: the kernel backs the range now
    assert huge_page_bytes() - before >= (pages - 1) * HUGE_PAGE  # allow one page it could not find
    del t
