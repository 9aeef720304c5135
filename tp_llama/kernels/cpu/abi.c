/* The library's description of itself, read by ffi.py: the constants' values, and each struct's
 * size and field offsets as this compiler laid them out. A field missing here, or a struct
 * ffi.py reads from api.h that is not here, stops the library from loading. */
#include <stddef.h>
#include <string.h>

#include "api.h"

static const struct {
    const char *name;
    int64_t value;
} CONSTANTS[] = {
    {"TILE_COLS", TILE_COLS}, {"GATE_RUN", GATE_RUN}, {"MAX_HEAD_DIM", MAX_HEAD_DIM}, {"WIDE_MIN_ROWS", WIDE_MIN_ROWS},
    {"KEY_RUN", KEY_RUN}, {"AMX_PACKED_X", AMX_PACKED_X}, {"AMX_PACKED_Y", AMX_PACKED_Y},
    {"QBLOCK", QBLOCK}, {"META_INT4", META_INT4}, {"Q8_PAIRS", Q8_PAIRS},
    {"TPL_OK", TPL_OK}, {"TPL_NO_MEMORY", TPL_NO_MEMORY}, {"TPL_OFF_CACHE", TPL_OFF_CACHE},
    {"TPL_HEAD_DIM", TPL_HEAD_DIM}, {"TPL_NO_AMX", TPL_NO_AMX}, {"TPL_BAD_TOKEN", TPL_BAD_TOKEN},
};

#define STRUCT(S) {#S, NULL, sizeof(struct S)}
#define FIELD(S, F) {#S, #F, offsetof(struct S, F)}
static const struct {
    const char *name, *field;
    size_t at; /* the size for the struct's own entry, the offset for a field's */
} LAYOUT[] = {
    STRUCT(DecodeLayer), FIELD(DecodeLayer, dim), FIELD(DecodeLayer, n_heads), FIELD(DecodeLayer, n_kv_heads),
    FIELD(DecodeLayer, head_dim), FIELD(DecodeLayer, ffn), FIELD(DecodeLayer, n_blocks),
    FIELD(DecodeLayer, block_size), FIELD(DecodeLayer, eps), FIELD(DecodeLayer, bf16), FIELD(DecodeLayer, amx),
    FIELD(DecodeLayer, bits),
    FIELD(DecodeLayer, attention_norm), FIELD(DecodeLayer, ffn_norm), FIELD(DecodeLayer, wqkv),
    FIELD(DecodeLayer, wo), FIELD(DecodeLayer, w13), FIELD(DecodeLayer, w2), FIELD(DecodeLayer, cache_k),
    FIELD(DecodeLayer, cache_v), FIELD(DecodeLayer, lora_qkv), FIELD(DecodeLayer, lora_wo),
    FIELD(DecodeLayer, lora_w13), FIELD(DecodeLayer, lora_w2),
    STRUCT(LoraWeights), FIELD(LoraWeights, a), FIELD(LoraWeights, bt), FIELD(LoraWeights, first),
    FIELD(LoraWeights, slots), FIELD(LoraWeights, rank), FIELD(LoraWeights, lines), FIELD(LoraWeights, bf16),
    STRUCT(MetaInt4), FIELD(MetaInt4, tiles), FIELD(MetaInt4, row_sums), FIELD(MetaInt4, lora_a),
    FIELD(MetaInt4, lora_bt), FIELD(MetaInt4, lora_ends), FIELD(MetaInt4, rank), FIELD(MetaInt4, lora_parts),
    FIELD(MetaInt4, lora_scale), FIELD(MetaInt4, hadamard),
    STRUCT(SampleRow), FIELD(SampleRow, row), FIELD(SampleRow, top_k), FIELD(SampleRow, temperature),
    FIELD(SampleRow, top_p), FIELD(SampleRow, min_p), FIELD(SampleRow, uniform),
    FIELD(SampleRow, allowed), FIELD(SampleRow, token),
    STRUCT(PenaltyRow), FIELD(PenaltyRow, row), FIELD(PenaltyRow, tokens), FIELD(PenaltyRow, n_prompt),
    FIELD(PenaltyRow, n_output), FIELD(PenaltyRow, bias_ids), FIELD(PenaltyRow, bias_values), FIELD(PenaltyRow, n_bias),
    FIELD(PenaltyRow, repetition), FIELD(PenaltyRow, frequency), FIELD(PenaltyRow, presence),
    STRUCT(DecodeRows), FIELD(DecodeRows, rows), FIELD(DecodeRows, width), FIELD(DecodeRows, rotation),
    FIELD(DecodeRows, tables), FIELD(DecodeRows, positions), FIELD(DecodeRows, adapters),
};

int64_t tpl_constant(const char *name, int64_t *value) {
    for (size_t i = 0; i < sizeof(CONSTANTS) / sizeof(CONSTANTS[0]); i++)
        if (strcmp(CONSTANTS[i].name, name) == 0) {
            *value = CONSTANTS[i].value;
            return 0;
        }
    return -1;
}

static int64_t layout(const char *name, const char *field) {
    for (size_t i = 0; i < sizeof(LAYOUT) / sizeof(LAYOUT[0]); i++)
        if (strcmp(LAYOUT[i].name, name) == 0 &&
            (field == NULL ? LAYOUT[i].field == NULL : LAYOUT[i].field != NULL && strcmp(LAYOUT[i].field, field) == 0))
            return (int64_t)LAYOUT[i].at;
    return -1;
}

int64_t tpl_struct_size(const char *name) { return layout(name, NULL); }

int64_t tpl_field_offset(const char *name, const char *field) { return layout(name, field); }
