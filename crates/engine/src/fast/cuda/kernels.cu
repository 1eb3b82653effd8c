// The fast tier's kernels of our own (the quantized matmuls are llama.cpp's, through
// candle-kernels). Every kernel here has a Rust twin over the same memory layout in
// crates/engine/src/fast/twin/ (named beside each kernel) and the contract stated there:
// integer parts bit-exact, floats within the twin's tolerance. Launch configurations come from
// crates/engine/src/fast/launch.rs, which is unit-tested on the CPU.
//
// Layouts (crates/engine/src/fast/layout.rs):
// - activations: f32, row-major [rows][width];
// - KV arena: f16, [block][layer][K=0,V=1][kv head][16 positions][head dim];
// - step tables: u32 arrays uploaded per step (slots, row -> sequence, sequences, block tables).

#include <cuda_fp16.h>
#include <stdint.h>

#define BLOCK_POSITIONS 16
#define MAX_GROUP 8
#define MAX_HEAD_DIM 256
#define SPLIT_POSITIONS 512
#define SKIP_SLOT 0xffffffffu

// ---------------------------------------------------------------------------------------------
// Embedding rows (twin: the CPU runner's ggml dequantization, `fast::cpu::dequantize_row`).
// ggml's block layouts; one value dequantized per thread.
// ---------------------------------------------------------------------------------------------

struct q4_0 { half d; uint8_t qs[16]; };
struct q4_1 { half d; half m; uint8_t qs[16]; };
struct q5_0 { half d; uint8_t qh[4]; uint8_t qs[16]; };
struct q5_1 { half d; half m; uint8_t qh[4]; uint8_t qs[16]; };
struct q8_0 { half d; int8_t qs[32]; };
struct q2_k { uint8_t scales[16]; uint8_t qs[64]; half d; half dmin; };
struct q3_k { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; half d; };
struct q4_k { half d; half dmin; uint8_t scales[12]; uint8_t qs[128]; };
struct q5_k { half d; half dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; };
struct q6_k { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; half d; };

__device__ __forceinline__ uint32_t load_u32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

// ggml's get_scale_min_k4.
__device__ __forceinline__ void scale_min_k4(int j, const uint8_t *q, int *d, int *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

__device__ float dq_q4_0(const void *b, int i) {
    const q4_0 *x = (const q4_0 *)b;
    const int q = i < 16 ? (x->qs[i] & 0xF) : (x->qs[i - 16] >> 4);
    return __half2float(x->d) * (float)(q - 8);
}
__device__ float dq_q4_1(const void *b, int i) {
    const q4_1 *x = (const q4_1 *)b;
    const int q = i < 16 ? (x->qs[i] & 0xF) : (x->qs[i - 16] >> 4);
    return __half2float(x->d) * (float)q + __half2float(x->m);
}
__device__ float dq_q5_0(const void *b, int i) {
    const q5_0 *x = (const q5_0 *)b;
    const uint32_t qh = load_u32(x->qh);
    const int lo = i < 16 ? (x->qs[i] & 0xF) : (x->qs[i - 16] >> 4);
    const int q = lo | (((qh >> i) & 1) << 4);
    return __half2float(x->d) * (float)(q - 16);
}
__device__ float dq_q5_1(const void *b, int i) {
    const q5_1 *x = (const q5_1 *)b;
    const uint32_t qh = load_u32(x->qh);
    const int lo = i < 16 ? (x->qs[i] & 0xF) : (x->qs[i - 16] >> 4);
    const int q = lo | (((qh >> i) & 1) << 4);
    return __half2float(x->d) * (float)q + __half2float(x->m);
}
__device__ float dq_q8_0(const void *b, int i) {
    const q8_0 *x = (const q8_0 *)b;
    return __half2float(x->d) * (float)x->qs[i];
}
__device__ float dq_q2_k(const void *b, int i) {
    const q2_k *x = (const q2_k *)b;
    const int n = i / 128, r = i % 128, j = r / 32, l = r % 32;
    const int sc = x->scales[n * 8 + j * 2 + l / 16];
    const int q = (x->qs[n * 32 + l] >> (2 * j)) & 3;
    return __half2float(x->d) * (float)(sc & 0xF) * (float)q - __half2float(x->dmin) * (float)(sc >> 4);
}
__device__ float dq_q3_k(const void *b, int i) {
    const q3_k *x = (const q3_k *)b;
    const int n = i / 128, r = i % 128, j = r / 32, l = r % 32;
    const int k = n * 8 + j * 2 + l / 16;
    const int low = k < 8 ? (x->scales[k] & 0xF) : (x->scales[k - 8] >> 4);
    const int high = (x->scales[8 + (k % 4)] >> (2 * (k / 4))) & 3;
    const int sc = (low | (high << 4)) - 32;
    const int q = (x->qs[n * 32 + l] >> (2 * j)) & 3;
    const int hbit = x->hmask[l] & (1 << (n * 4 + j));
    return __half2float(x->d) * (float)sc * (float)(q - (hbit ? 0 : 4));
}
__device__ float dq_q4_k(const void *b, int i) {
    const q4_k *x = (const q4_k *)b;
    const int c = i / 64, r = i % 64, l = r % 32;
    int sc, m;
    scale_min_k4(2 * c + r / 32, x->scales, &sc, &m);
    const uint8_t q = x->qs[32 * c + l];
    const int nib = r < 32 ? (q & 0xF) : (q >> 4);
    return __half2float(x->d) * (float)sc * (float)nib - __half2float(x->dmin) * (float)m;
}
__device__ float dq_q5_k(const void *b, int i) {
    const q5_k *x = (const q5_k *)b;
    const int c = i / 64, r = i % 64, l = r % 32;
    int sc, m;
    scale_min_k4(2 * c + r / 32, x->scales, &sc, &m);
    const uint8_t q = x->qs[32 * c + l];
    const int hi = (x->qh[l] >> (2 * c + (r < 32 ? 0 : 1))) & 1;
    const int v = (r < 32 ? (q & 0xF) : (q >> 4)) + 16 * hi;
    return __half2float(x->d) * (float)sc * (float)v - __half2float(x->dmin) * (float)m;
}
__device__ float dq_q6_k(const void *b, int i) {
    const q6_k *x = (const q6_k *)b;
    const int n = i / 128, r = i % 128, l = r % 32, quarter = r / 32;
    const uint8_t ql = x->ql[64 * n + l + (quarter & 1) * 32];
    const int low = (quarter >= 2 ? (ql >> 4) : ql) & 0xF;
    const int high = (x->qh[32 * n + l] >> (2 * quarter)) & 3;
    const int sc = x->scales[8 * n + l / 16 + 2 * quarter];
    return __half2float(x->d) * (float)sc * (float)((low | (high << 4)) - 32);
}

#define GET_ROWS(name, block_t, qk)                                                             \
    extern "C" __global__ void get_rows_##name(const uint8_t *__restrict__ table,                \
                                               const uint32_t *__restrict__ tokens,             \
                                               float *__restrict__ out, int cols) {              \
        const int row = blockIdx.x;                                                              \
        const size_t row_bytes = (size_t)(cols / qk) * sizeof(block_t);                          \
        const uint8_t *src = table + (size_t)tokens[row] * row_bytes;                            \
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {                                   \
            out[(size_t)row * cols + c] = dq_##name(src + (c / qk) * sizeof(block_t), c % qk);   \
        }                                                                                        \
    }

GET_ROWS(q4_0, q4_0, 32)
GET_ROWS(q4_1, q4_1, 32)
GET_ROWS(q5_0, q5_0, 32)
GET_ROWS(q5_1, q5_1, 32)
GET_ROWS(q8_0, q8_0, 32)
GET_ROWS(q2_k, q2_k, 256)
GET_ROWS(q3_k, q3_k, 256)
GET_ROWS(q4_k, q4_k, 256)
GET_ROWS(q5_k, q5_k, 256)
GET_ROWS(q6_k, q6_k, 256)

// ---------------------------------------------------------------------------------------------
// Reductions.
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffff, x, m);
    return x;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024).
__device__ float block_sum(float x) {
    __shared__ float part[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    x = warp_sum(x);
    if (lane == 0) part[warp] = x;
    __syncthreads();
    const int warps = blockDim.x / 32;
    x = threadIdx.x < warps ? part[threadIdx.x] : 0.0f;
    if (warp == 0) x = warp_sum(x);
    if (threadIdx.x == 0) part[0] = x;
    __syncthreads();
    const float total = part[0];
    __syncthreads();
    return total;
}

// ---------------------------------------------------------------------------------------------
// RMSNorm (twin: fast::twin::norm::rms_norm). One block per row.
// ---------------------------------------------------------------------------------------------

extern "C" __global__ void rms_norm(const float *__restrict__ x, const float *__restrict__ w,
                                    float *__restrict__ out, int cols, float eps) {
    const size_t row = blockIdx.x;
    const float *xr = x + row * cols;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) ss += xr[c] * xr[c];
    ss = block_sum(ss);
    const float scale = rsqrtf(ss / (float)cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) out[row * cols + c] = xr[c] * scale * w[c];
}

// ---------------------------------------------------------------------------------------------
// Element-wise steps (twins: fast::twin::norm::{add, silu_mul}).
// ---------------------------------------------------------------------------------------------

extern "C" __global__ void add_f32(float *__restrict__ x, const float *__restrict__ y, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

extern "C" __global__ void silu_mul(float *__restrict__ gate, const float *__restrict__ up, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float g = gate[i];
        gate[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

// `out[i] = x[rows[i]]`, rows of `cols` values; one block per output row.
extern "C" __global__ void gather_rows(const float *__restrict__ x, const uint32_t *__restrict__ rows,
                                       float *__restrict__ out, int cols) {
    const size_t i = blockIdx.x;
    const float *src = x + (size_t)rows[i] * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) out[i * cols + c] = src[c];
}

// ---------------------------------------------------------------------------------------------
// RoPE and the K/V write (twins: fast::twin::rope::{rotate, write_kv}).
// ---------------------------------------------------------------------------------------------

// Rotates adjacent pairs (2i, 2i+1), i < rope_dim / 2, of every head; cos/sin are
// [rows][rope_dim / 2], computed on the host. Grid (rows, heads), block rope_dim / 2.
extern "C" __global__ void rope(float *__restrict__ x, const float *__restrict__ cos_t,
                                const float *__restrict__ sin_t, int heads, int head_dim,
                                int rope_dim) {
    const int row = blockIdx.x, head = blockIdx.y, i = threadIdx.x;
    const int half_dim = rope_dim / 2;
    if (i >= half_dim) return;
    float *h = x + ((size_t)row * heads + head) * head_dim;
    const float c = cos_t[row * half_dim + i], s = sin_t[row * half_dim + i];
    const float a = h[2 * i], b = h[2 * i + 1];
    h[2 * i] = a * c - b * s;
    h[2 * i + 1] = a * s + b * c;
}

__device__ __forceinline__ size_t arena_index(uint32_t block, int layer, int kind, int head,
                                              int slot, int layers, int kv_heads, int head_dim) {
    const size_t page = (((size_t)block * layers + layer) * 2 + kind) * kv_heads + head;
    return page * (BLOCK_POSITIONS * head_dim) + (size_t)slot * head_dim;
}

// K and V of every row into the arena at the row's slot. Grid (rows, kv_heads), block head_dim.
extern "C" __global__ void kv_write(const float *__restrict__ k, const float *__restrict__ v,
                                    const uint32_t *__restrict__ slots, half *__restrict__ arena,
                                    int layer, int layers, int kv_heads, int head_dim) {
    const int row = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
    if (d >= head_dim) return;
    const uint32_t slot = slots[row];
    if (slot == SKIP_SLOT) return;  // a padded row of a graphed decode step
    const size_t src = ((size_t)row * kv_heads + head) * head_dim + d;
    const uint32_t block = slot / BLOCK_POSITIONS;
    const int at = slot % BLOCK_POSITIONS;
    arena[arena_index(block, layer, 0, head, at, layers, kv_heads, head_dim) + d] = __float2half(k[src]);
    arena[arena_index(block, layer, 1, head, at, layers, kv_heads, head_dim) + d] = __float2half(v[src]);
}

// ---------------------------------------------------------------------------------------------
// Paged attention (twin: fast::twin::attention). One block per (row, KV head, split): the
// `group` query heads sharing the KV head are computed together, each key and value row read
// once for all of them. Keys in blocks of 16 positions, online softmax; a decode row (its
// sequence has one new row) over more than SPLIT_POSITIONS positions is split along the context
// and `attention_merge` combines the splits. Block: 128 threads (4 warps); head_dim <= 256.
// ---------------------------------------------------------------------------------------------

struct SeqInfo {
    uint32_t row0, rows, past, index;
};

// Partials: max and sum [rows][heads][max_splits], output [rows][heads][max_splits][head_dim].
// GROUP (query heads per KV head) is a template parameter so the per-head accumulators stay in
// registers; `attention_partial_gN` are the instances.
template <int GROUP>
__device__ void attention_partial_impl(
    const float *__restrict__ q, const half *__restrict__ arena,
    const uint32_t *__restrict__ row_seq, const SeqInfo *__restrict__ seqs,
    const uint32_t *__restrict__ block_tables, int max_blocks, float *__restrict__ part_max,
    float *__restrict__ part_sum, float *__restrict__ part_out, int max_splits, int layer,
    int layers, int heads, int kv_heads, int head_dim) {
    __shared__ float q_s[GROUP * MAX_HEAD_DIM];
    __shared__ float scores[GROUP * BLOCK_POSITIONS];
    const int row = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z;
    const SeqInfo seq = seqs[row_seq[row]];
    const int r = row - (int)seq.row0;
    const int visible = (int)seq.past + r + 1;
    const int n_splits = seq.rows == 1 ? (visible + SPLIT_POSITIONS - 1) / SPLIT_POSITIONS : 1;
    if (split >= n_splits) return;
    const int from = split * SPLIT_POSITIONS;
    const int to = n_splits == 1 ? visible : min((split + 1) * SPLIT_POSITIONS, visible);
    const uint32_t *blocks = block_tables + (size_t)seq.index * max_blocks;
    const float scale = rsqrtf((float)head_dim);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    for (int i = threadIdx.x; i < GROUP * head_dim; i += blockDim.x) {
        const int g = i / head_dim, d = i % head_dim;
        q_s[g * MAX_HEAD_DIM + d] = q[((size_t)row * heads + kv_head * GROUP + g) * head_dim + d];
    }
    float m[GROUP], l[GROUP], o0[GROUP], o1[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        o0[g] = 0.0f;
        o1[g] = 0.0f;
    }
    const int d0 = threadIdx.x, d1 = threadIdx.x + blockDim.x;
    __syncthreads();
    for (int pos = from; pos < to;) {
        const uint32_t block = blocks[pos / BLOCK_POSITIONS];
        const int end = min((pos / BLOCK_POSITIONS + 1) * BLOCK_POSITIONS, to);
        const int n = end - pos;
        // Scores: warp w takes keys w, w + warps, ...; lanes stride the head dimension.
        for (int key = warp; key < n; key += warps) {
            const half *k = arena + arena_index(block, layer, 0, kv_head, (pos + key) % BLOCK_POSITIONS,
                                                layers, kv_heads, head_dim);
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                float acc = 0.0f;
                for (int d = lane; d < head_dim; d += 32) acc += q_s[g * MAX_HEAD_DIM + d] * __half2float(k[d]);
                acc = warp_sum(acc);
                if (lane == 0) scores[g * BLOCK_POSITIONS + key] = acc * scale;
            }
        }
        __syncthreads();
        // Online softmax update; thread t owns dimensions t and t + blockDim.x.
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            float block_max = -INFINITY;
            for (int key = 0; key < n; ++key) block_max = fmaxf(block_max, scores[g * BLOCK_POSITIONS + key]);
            const float new_max = fmaxf(m[g], block_max);
            const float factor = expf(m[g] - new_max);
            l[g] *= factor;
            o0[g] *= factor;
            o1[g] *= factor;
            for (int key = 0; key < n; ++key) {
                const float w = expf(scores[g * BLOCK_POSITIONS + key] - new_max);
                l[g] += w;
                const half *v = arena + arena_index(block, layer, 1, kv_head, (pos + key) % BLOCK_POSITIONS,
                                                    layers, kv_heads, head_dim);
                if (d0 < head_dim) o0[g] += w * __half2float(v[d0]);
                if (d1 < head_dim) o1[g] += w * __half2float(v[d1]);
            }
            m[g] = new_max;
        }
        __syncthreads();
        pos = end;
    }
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        const size_t at = ((size_t)row * heads + kv_head * GROUP + g) * max_splits + split;
        if (threadIdx.x == 0) {
            part_max[at] = m[g];
            part_sum[at] = l[g];
        }
        if (d0 < head_dim) part_out[at * head_dim + d0] = o0[g];
        if (d1 < head_dim) part_out[at * head_dim + d1] = o1[g];
    }
}

#define ATTENTION_PARTIAL(G)                                                                     \
    extern "C" __global__ void __launch_bounds__(128, 4) attention_partial_g##G(                   \
        const float *__restrict__ q, const half *__restrict__ arena,                             \
        const uint32_t *__restrict__ row_seq, const SeqInfo *__restrict__ seqs,                  \
        const uint32_t *__restrict__ block_tables, int max_blocks, float *__restrict__ part_max, \
        float *__restrict__ part_sum, float *__restrict__ part_out, int max_splits, int layer,   \
        int layers, int heads, int kv_heads, int head_dim) {                                     \
        attention_partial_impl<G>(q, arena, row_seq, seqs, block_tables, max_blocks, part_max,   \
                                  part_sum, part_out, max_splits, layer, layers, heads,          \
                                  kv_heads, head_dim);                                           \
    }

ATTENTION_PARTIAL(1)
ATTENTION_PARTIAL(2)
ATTENTION_PARTIAL(3)
ATTENTION_PARTIAL(4)
ATTENTION_PARTIAL(5)
ATTENTION_PARTIAL(6)
ATTENTION_PARTIAL(7)
ATTENTION_PARTIAL(8)

// Combines a row's splits per head, in split order (twin: fast::twin::attention::merge).
// Grid (rows, heads), block head_dim.
extern "C" __global__ void attention_merge(
    const uint32_t *__restrict__ row_seq, const SeqInfo *__restrict__ seqs,
    const float *__restrict__ part_max, const float *__restrict__ part_sum,
    const float *__restrict__ part_out, float *__restrict__ out, int max_splits, int heads,
    int head_dim) {
    const int row = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
    if (d >= head_dim) return;
    const SeqInfo seq = seqs[row_seq[row]];
    const int visible = (int)seq.past + (row - (int)seq.row0) + 1;
    const int n_splits = seq.rows == 1 ? (visible + SPLIT_POSITIONS - 1) / SPLIT_POSITIONS : 1;
    const size_t base = ((size_t)row * heads + head) * max_splits;
    float max = -INFINITY;
    for (int s = 0; s < n_splits; ++s) max = fmaxf(max, part_max[base + s]);
    float sum = 0.0f, acc = 0.0f;
    for (int s = 0; s < n_splits; ++s) {
        const float w = expf(part_max[base + s] - max);
        sum += part_sum[base + s] * w;
        acc += part_out[(base + s) * head_dim + d] * w;
    }
    out[((size_t)row * heads + head) * head_dim + d] = acc / sum;
}
