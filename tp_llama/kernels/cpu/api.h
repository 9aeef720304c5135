/* The C kernels' one interface: every constant, status code, struct and function of the library.
 *
 * Python never restates any of it. ffi.py reads this file for the structs' fields and the
 * functions' signatures (so it is kept to a small subset of C: one struct or prototype per
 * statement, types among void, int, int32_t, int64_t, uint32_t, float, double, char and struct NAME, each maybe
 * const and a pointer; a pointer to pointers is passed as an address too), reads every constant's
 * value from the built library (tpl_constant), and checks each struct's size and field offsets
 * against the library (tpl_struct_size, tpl_field_offset) before any kernel runs.
 *
 * The in-region kernels run inside an OpenMP parallel region: every thread of the region calls
 * them, the threads split the work, and each ends in a barrier, so a caller can chain several in
 * one region (decode.c) instead of starting one per operation. The others start their own region.
 */
#ifndef TP_LLAMA_API_H
#define TP_LLAMA_API_H

#include <stdint.h>

/* Constants */
#define TILE_COLS 32             /* output columns per weight tile (matmul.c) */
#define GATE_RUN (TILE_COLS / 2) /* a gated tile: this many w1 rows, then as many w3 rows */
#define MAX_HEAD_DIM 256         /* a query and its sums in registers (Llama's heads are 64 or 128) */
#define WIDE_MIN_ROWS 16         /* `wide` scratch holds at least this many rows: AMX packs 32 there */
#define KEY_RUN 16               /* keys scored at once; KV-cache blocks are a multiple of it */
#define AMX_PACKED_X 1           /* amx_matmul's layout: x comes packed (an AMX_PACKED_Y output) */
#define AMX_PACKED_Y 2           /* amx_matmul's layout: y goes out packed, as the next matmul's x */
#define QBLOCK 32                /* k per block of a quantized weight and of x quantized (quant.c) */
#define META_INT4 1              /* DecodeLayer.bits of Meta's int4 checkpoints: its weights are struct MetaInt4 */
#define Q8_PAIRS 88              /* quant.c's bits for int8 weights in pair tiles, whose inputs are quantized to int16 */

/* Status codes */
#define TPL_OK 0
#define TPL_NO_MEMORY -1    /* scratch memory could not be had */
#define TPL_OFF_CACHE -2    /* a row's position or one of its blocks lies outside its table or the cache */
#define TPL_HEAD_DIM -3     /* head_dim over MAX_HEAD_DIM */
#define TPL_NO_AMX -4       /* no AMX here (CPU, kernel permission, build) or a width it cannot take */
#define TPL_BAD_TOKEN -5    /* a token id outside the vocabulary */

/* One projection's LoRA adapters in fixed slots (lora.c), float32 or, with bf16, bfloat16 (the model's
 * type): a [slots][rank][K] and bt, B^T with the scale folded in, in vectors of 16 output columns,
 * [slots][ceil(N / 16)][lines][16] (zeros past N): vector v holds ranks first[v] .. first[v] + lines - 1,
 * B^T being zero at the others there (a fused projection's B is block-diagonal), so a step reads only
 * the blocks, each vector's in one run. Slot 0 is the base and is never read. A smaller adapter, or one
 * that leaves the projection alone, is zeros there. */
struct LoraWeights {
    const void *a, *bt;
    const int32_t *first;
    int64_t slots, rank, lines;
    int32_t bf16;
};

/* One layer's shapes (this rank's share) and tensors, for decode.c. lora_*: each projection's adapters,
 * NULL where it has none (bt of lora_w13 in the gated tiles' interleaved column order); META_INT4
 * layers take none. */
struct DecodeLayer {
    int64_t dim, n_heads, n_kv_heads, head_dim, ffn, n_blocks, block_size; /* n_blocks: the spare too */
    float eps;
    int32_t bf16, amx; /* amx: bfloat16 matmuls on AMX */
    int32_t bits;      /* 16: the weights in matmul.c's tiles (float32 or bfloat16); 8 or 4: quant.c's; META_INT4 */
    const void *attention_norm, *ffn_norm, *wqkv, *wo, *w13, *w2;
    void *cache_k, *cache_v;
    const struct LoraWeights *lora_qkv, *lora_wo, *lora_w13, *lora_w2;
};

/* One of Meta's int4 weights [N][K] (kernels/meta_int4.py's pack_tiles): its int4 tiles (quant.c), the
 * sums of its rows along k (float32 [N]), and where lora_a is not NULL QLoRA's adaptor, lora_scale *
 * (x A^T) B^T with A [rank][K] in bfloat16, as Meta ships it. B is block-diagonal where weights fused
 * (q/k/v, w1/w3): part i (of lora_parts) owns outputs lora_ends[i - 1] .. lora_ends[i] - 1 (multiples
 * of 16) and ranks i * rank / lora_parts on, so B^T (lora_bt) holds only the blocks, [rank / lora_parts][N]
 * bfloat16. hadamard: decode.c rotates its input first (SpinQuant's w2). A DecodeLayer of bits
 * META_INT4 points at four. */
struct MetaInt4 {
    const void *tiles, *row_sums, *lora_a, *lora_bt;
    const int64_t *lora_ends;
    int64_t rank, lora_parts;
    float lora_scale;
    int32_t hadamard;
};

/* One row to sample (sample.c): its filters, its uniform draw and its grammar's mask in, its token out. */
struct SampleRow {
    int64_t row;       /* which row of the logits */
    int64_t top_k;     /* 0: no limit */
    float temperature; /* > 0 */
    float top_p;       /* (0, 1] */
    float min_p;       /* [0, 1] */
    double uniform;    /* [0, 1) */
    const uint32_t *allowed; /* ceil(vocab / 32) words, bit j of word w allowing token 32 w + j; NULL: all */
    int64_t token;
};

/* One row's logit_bias and penalties (sample.c), in vLLM's order: the bias (a logits processor there), then
 * repetition over the prompt's and the output's tokens, then frequency and presence over the output's. */
struct PenaltyRow {
    int64_t row;           /* which row of the logits */
    const int64_t *tokens; /* the prompt's n_prompt ids, then the output's n_output */
    int64_t n_prompt, n_output;
    const int64_t *bias_ids;
    const float *bias_values;
    int64_t n_bias;
    float repetition;           /* 1: none */
    double frequency, presence; /* 0: none */
};

/* A decode step's rows: one new token each, each with its block table. */
struct DecodeRows {
    int64_t rows, width;
    const float *rotation; /* [rows][head_dim]: cos, sin pairs at the row's position */
    const int64_t *tables, *positions; /* tables [rows][width]: the blocks of positions 0, block_size, ... */
    const int32_t *adapters;           /* [rows]: each row's LoRA slot; NULL: every row the base */
};

/* Weights in tiles (matmul.c). A weight [N][K] of 4-byte units (a float32, or a pair of bfloat16
 * along k) becomes [tiles][K][TILE_COLS]; gated weights interleave w1 and w3 in runs of GATE_RUN.
 * amx: bfloat16 pairs in AMX's layout instead where K is a multiple of 16 (amx.c). */
void pack_tiles(const uint32_t *w, int64_t N, int64_t K, uint32_t *out, int amx);

/* y [M][N] = x [M][K] @ w^T (gated: y [M][N / 2] = silu(x w1^T) * (x w3^T)); 0 or TPL_NO_MEMORY.
 * amx: bfloat16 calls run on AMX (after amx_enable) where K is a multiple of 32. */
int tiled_linear(const void *x, int64_t M, int64_t K, const void *w, int64_t N, void *y, int gated, int bf16,
                 int amx);

/* How many chunks of rows (of up to 8 on AVX-512) a tile call must have before it asks for the
 * thread's next tile while it computes: 1, every call (Intel, where they keep more lines in flight),
 * or 2 (AMD's Zen 5, where they slow one-row passes; bench/kernels/matmul.py). ffi.py sets it at
 * load, before any call. */
void set_next_tile_min_chunks(int chunks);

/* Weights quantized at load (quant.c): y [M][N] = x [M][K] @ w^T, x and y float32 or bfloat16 (bf16),
 * w int8 or int4 (bits) tiles from pack_quant_tiles, or int8 pair tiles (Q8_PAIRS: kernels/cpu/qtiles.py
 * packs them), K a multiple of QBLOCK; gated as tiled_linear.
 * TPL_OK or TPL_NO_MEMORY. quant_matmul is its in-region form, with quant_scratch_bytes(M, K) of scratch. */
int quant_linear(const void *x, int64_t M, int64_t K, const void *w, int64_t N, void *y, int gated, int bf16,
                 int bits);
void quant_matmul(const void *x, int64_t M, int64_t K, const void *w, int64_t N, void *y, int gated, int bf16,
                  int bits, void *scratch);
int64_t quant_scratch_bytes(int64_t M, int64_t K);
/* Meta's int4 checkpoints (kernels/meta_int4.py): each row of x [M][K] (float32, or bfloat16: bf16) quantized
 * to int8 as torchao's per-token asymmetric quantization does, over its range from bounds [M][2] float32
 * (the row's max and -min: under TP the whole row's) or, where bounds is NULL, its own; then y [M][N]
 * float32 = the dequantized rows @ w^T, plus QLoRA's adaptor on x itself where w has one.
 * TPL_OK or TPL_NO_MEMORY. meta_int4_matmul is its in-region form, with meta_int4_scratch_bytes(M, K,
 * w->rank) of scratch. */
int meta_int4_linear(const void *x, const void *bounds, int64_t M, int64_t K, const struct MetaInt4 *w, int64_t N,
                     float *y, int bf16);
void meta_int4_matmul(const void *x, const void *bounds, int64_t M, int64_t K, const struct MetaInt4 *w, int64_t N,
                      float *y, int bf16, void *scratch);
int64_t meta_int4_scratch_bytes(int64_t M, int64_t K, int64_t R);
/* Each row of x [M][n] (n a power of two) times the Sylvester Hadamard matrix over sqrt(n), into y float32
 * (in place where x is y): log2(n) butterfly passes in the order kernels.meta_int4.walsh_hadamard takes
 * them (SpinQuant's w2 input). hadamard_rows_in is the in-region form, of float32 or bfloat16 (bf16) x. */
void hadamard_rows(void *x, int64_t M, int64_t n);
void hadamard_rows_in(const void *x, int64_t M, int64_t n, int bf16, float *y);
/* q [N][K] int8 (int4: values 0..15, a byte each), scales and (int4) mins [N][K / QBLOCK] fp16 bits,
 * into tiles at out: N rounded up to TILE_COLS, times K / QBLOCK blocks of quant_block_bytes(bits). */
void pack_quant_tiles(const void *q, const void *scales, const void *mins, int64_t N, int64_t K, int bits, void *out);
int64_t quant_block_bytes(int bits);
/* w [N][K] float32 or bfloat16 (bf16) quantized per group of QBLOCK along k into q [N][K] and fp16
 * scales [N][K / QBLOCK]: int8 symmetric; int4 with minimums too; the scale (and minimum) refit by
 * least squares up to `refits` times where that lowers the group's error. */
void quantize_groups(const void *w, int64_t N, int64_t K, int bf16, int bits, int refits, void *q, void *scales,
                     void *mins);

/* amx_enable asks Linux for AMX's tile state, once per process, before any AMX call. */
int amx_enable(void);

/* A prompt chunk's causal attention (prompt_attention.c; AMX tiles in the AMX build, vdpbf16ps or
 * FMAs in the others): rows at positions start .. of one sequence, its q heads at the start of each
 * row of qkv [rows][ld] bfloat16 (rotated), against the sequence's keys and values 0 .. start +
 * rows - 1 in cache_k/v [n_kv_heads][n_blocks * block_size][head_dim] through its block table; out
 * [rows][ld_out] gets each row's n_heads * head_dim outputs. TPL_OK, TPL_NO_MEMORY, TPL_OFF_CACHE
 * (a block outside the cache), or TPL_HEAD_DIM (head_dim not a multiple of 64, or over MAX_HEAD_DIM). */
int prompt_attention(const void *qkv, int64_t rows, int64_t ld, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                     const void *cache_k, const void *cache_v, int64_t n_blocks, int64_t block_size,
                     const int64_t *table, int64_t start, void *out, int64_t ld_out);

/* Layer ops (layer.c). */
void rms_norm(const void *x, const void *weight, void *y, int64_t rows, int64_t dim, float eps, int bf16);
/* Attention of rows each at its own position (RoPE on its q and k, its key and value written to the
 * cache, softmax(qK)V over its blocks): a decode step's rows, or with write_first a prompt chunk's
 * (every row's key written before any row attends), with a decode row's bits either way. window
 * (a multiple of block_size; 0: none): a row sees only the keys of its window of positions. */
int decode_attention(const void *qkv, const struct DecodeRows *rows, int64_t n_heads,
                     int64_t n_kv_heads, int64_t head_dim, void *cache_k, void *cache_v, int64_t n_blocks,
                     int64_t block_size, void *out, int bf16, int write_first, int64_t window);
/* SwiGLU: y [M][F] = silu(gate) * up for x [M][2F], each row's F gate columns then its F up columns,
 * x and y float32 or bfloat16 (bf16), rounded where PyTorch's ops round. swiglu_rows is the in-region
 * form, x in its own type (x_bf16). */
void swiglu(const void *x, int64_t M, int64_t F, void *y, int bf16);
void swiglu_rows(const void *x, int64_t M, int64_t F, int x_bf16, void *y, int bf16);
/* Prompt rows' q and k rotated in place in qkv, their keys and values written to the cache at
 * locations[r] < cache_len (cache_k/v [n_kv_heads][cache_len][head_dim]). TPL_OK or TPL_OFF_CACHE. */
int rope_prompt_rows(void *qkv, int64_t rows, const float *rotation, const int64_t *locations, int64_t n_heads,
                     int64_t n_kv_heads, int64_t head_dim, void *cache_k, void *cache_v, int64_t cache_len, int bf16);

/* A decode step's layers (decode.c). */
int64_t decode_scratch_bytes(const struct DecodeLayer *layer, int64_t rows);
int attention_block(const struct DecodeLayer *layer, const struct DecodeRows *rows, void *h, const void *delta_in,
                    void *delta_out, void *scratch, int write_first);
void ffn_block(const struct DecodeLayer *layer, int64_t rows, const int32_t *adapters, void *h, const void *delta_in,
               void *delta_out, void *scratch);
void residual_norm(void *h, const void *delta, const void *weight, void *y, int64_t rows, int64_t dim, float eps,
                   int bf16);
int decode_stack(const struct DecodeLayer *layers, int64_t n_layers, const struct DecodeRows *rows, void *h,
                 void *delta, void *scratch, int write_first);

/* LoRA adapters per row (lora.c): y [M][N] += (x A_s^T) B_s^T for each row on slot s = adapters[m] in
 * 1 .. slots - 1 (others are the base), x [M][K] and y float32 or bfloat16 (bf16), t = x A_s^T kept in
 * float32 and the sum added to y once, rounded to its type. lora_rows is the in-region form, with
 * lora_scratch_bytes(M, rank) of scratch; lora_add starts its own region: TPL_OK or TPL_NO_MEMORY. */
void lora_rows(const struct LoraWeights *l, const void *x, int64_t M, int64_t K, const int32_t *adapters, void *y,
               int64_t N, int bf16, float *scratch);
int lora_add(const struct LoraWeights *l, const void *x, int64_t M, int64_t K, const int32_t *adapters, void *y,
             int64_t N, int bf16);
int64_t lora_scratch_bytes(int64_t M, int64_t R);

/* The next token of each row (sample.c): logits [rows][vocab] float32. A row with a mask draws as
 * it would with -inf at every token the mask refuses. TPL_OK or TPL_NO_MEMORY. */
int sample_rows(const float *logits, int64_t vocab, struct SampleRow *rows, int64_t n);
/* Each row's penalties on logits [rows][vocab] float32, in place. TPL_OK, TPL_NO_MEMORY or TPL_BAD_TOKEN. */
int penalize_rows(float *logits, int64_t vocab, const struct PenaltyRow *rows, int64_t n);
/* Each row's first index of its largest logit, as torch.argmax (a NaN counts as the largest):
 * logits [n][vocab] float32, out [n]. allowed: NULL, or n masks as SampleRow's (NULL for a free
 * row), each row taken as if every token its mask refuses were -inf. */
void argmax_rows(const float *logits, int64_t vocab, int64_t n, const uint32_t *const *allowed, int64_t *out);
/* For row rows[j] of logits [.][vocab] float32: lse[j], the log of its sum of exp, and its `top`
 * largest logits, best first (NaN ones last, by id), in values [n][top] with their ids [n][top]; top <= vocab. */
void top_logits(const float *logits, int64_t vocab, const int64_t *rows, int64_t n, int64_t top, double *lse,
                int64_t *ids, float *values);

/* In-region kernels. x widened into `wide` (max(M, WIDE_MIN_ROWS) * K floats) first when bf16, or
 * packed there for AMX. */
void tiled_matmul(const void *x, int64_t M, int64_t K, const void *w, int64_t N, void *y, int gated, int bf16,
                  float *wide, int amx);
/* The in-region AMX matmul (amx.c): bfloat16 x [M][K], scratch as tiled_matmul's wide (unused for
 * packed x); TPL_NO_AMX (for every thread, nothing written) where it cannot run: no AMX build, K not
 * a multiple of 32, or y packed with a width (N, or N / 2 gated) that is not. layout: AMX_PACKED_X
 * and AMX_PACKED_Y bits. Packed, a matrix is 32-row blocks of [K / 32][32 rows][32 k], its rows past
 * M unwritten (M rounded up to 32 in size). */
int amx_matmul(const void *x, int64_t M, int64_t K, const void *w, int64_t N, void *y, int gated, void *scratch,
               int layout);
/* This thread's tile registers as amx.c and prompt_attention.c use them (AMX builds only). */
void amx_configure(void);
void rms_norm_rows(const void *x, const void *weight, void *y, int64_t rows, int64_t dim, float eps, int bf16);
/* Rows already checked by check_rows; scores: max_threads * scores_per_thread floats. */
void attention_rows(const void *qkv, const struct DecodeRows *rows, int64_t n_heads, int64_t n_kv_heads,
                    int64_t head_dim, void *cache_k, void *cache_v, int64_t n_blocks, int64_t block_size, void *out,
                    int bf16, float *scores, int64_t scores_per_thread, int write_first, int64_t window);
/* TPL_OK where the blocks of a sequence's table that hold its positions 0 .. last all lie in the
 * cache's n_blocks, else TPL_OFF_CACHE. */
int blocks_in_cache(const int64_t *table, int64_t last, int64_t block_size, int64_t n_blocks);
/* TPL_OK, TPL_OFF_CACHE or TPL_HEAD_DIM; *scores_per_thread: the scratch attention_rows needs per thread. */
int check_rows(const struct DecodeRows *rows, int64_t n_blocks, int64_t block_size, int64_t n_heads,
               int64_t n_kv_heads, int64_t head_dim, int64_t *scores_per_thread);

/* The library's description of itself (abi.c): a constant's value, a struct's size, a field's
 * offset; -1 for a name it does not know (no constant is negative but the status codes, which
 * ffi.py reads as such). */
int64_t tpl_constant(const char *name, int64_t *value);
int64_t tpl_struct_size(const char *name);
int64_t tpl_field_offset(const char *name, const char *field);

#endif
