// The fast tier's kernels of our own (the matmuls of more than 8 rows are llama.cpp's MMQ,
// through candle-kernels, or cuBLAS; up to 8 rows they are the matvec kernels here). Every kernel here has a Rust twin over the same memory layout in
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

// Programmatic dependent launch (Hopper; the runner launches every kernel here with the
// programmatic-stream-serialization attribute): a kernel first waits until the grids before it
// in the stream have finished and their writes are visible, and reads nothing before that; then
// it lets the next launch be scheduled at once, so the next kernel's blocks are resident and
// waiting when this one ends instead of being launched then. Every kernel starts with it; without
// the attribute both instructions are no-ops.
#define GRID_DEPENDENCY()                                                                         \
    do {                                                                                          \
        asm volatile("griddepcontrol.wait;" ::: "memory");                                        \
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");                           \
    } while (0)

#define BLOCK_POSITIONS 16
#define MAX_GROUP 8
#define MAX_HEAD_DIM 256
#define MIN_SPLIT_POSITIONS 64
#define MAX_SPLITS 32
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
        GRID_DEPENDENCY();                                                                       \
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

// Whole weight matrices dequantized to f16, for the f16 matmuls of wide steps (cuBLAS, f32
// accumulation; twin: fast::twin::f16mm). Grid (rows), block 256; one value per thread a pass,
// rounded to nearest.
#define DEQUANTIZE_F16(name, block_t, qk)                                                        \
    extern "C" __global__ void dequantize_f16_##name(const uint8_t *__restrict__ table,          \
                                                     half *__restrict__ out, int cols) {         \
        GRID_DEPENDENCY();                                                                       \
        const int row = blockIdx.x;                                                              \
        const size_t row_bytes = (size_t)(cols / qk) * sizeof(block_t);                          \
        const uint8_t *src = table + (size_t)row * row_bytes;                                    \
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {                                   \
            out[(size_t)row * cols + c] =                                                        \
                __float2half_rn(dq_##name(src + (c / qk) * sizeof(block_t), c % qk));             \
        }                                                                                        \
    }

DEQUANTIZE_F16(q4_0, q4_0, 32)
DEQUANTIZE_F16(q4_1, q4_1, 32)
DEQUANTIZE_F16(q5_0, q5_0, 32)
DEQUANTIZE_F16(q5_1, q5_1, 32)
DEQUANTIZE_F16(q8_0, q8_0, 32)
DEQUANTIZE_F16(q2_k, q2_k, 256)
DEQUANTIZE_F16(q3_k, q3_k, 256)
DEQUANTIZE_F16(q4_k, q4_k, 256)
DEQUANTIZE_F16(q5_k, q5_k, 256)
DEQUANTIZE_F16(q6_k, q6_k, 256)

// Activations rounded to f16 for the same matmuls (twin: fast::twin::f16mm).
extern "C" __global__ void f32_to_f16(const float *__restrict__ x, half *__restrict__ y, int n) {
    GRID_DEPENDENCY();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2half_rn(x[i]);
}

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
// Q8_1 quantization fused into the kernel that produces a matmul's input (twin:
// fast::twin::q8_1), for steps whose matmuls take MMVQ: one launch instead of two. Each warp
// quantizes one block of 32 values exactly as candle-kernels' mmvq_gguf_quantize_q8_1_f32 does
// (the same butterfly reductions, IEEE division, roundf), so the Q8_1 rows are bit for bit the
// ones the separate launch would write.
// ---------------------------------------------------------------------------------------------

struct q8_1_block { half d; half s; int8_t qs[32]; };  // candle's block_q8_1: half2 ds, qs[32]

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, m));
    return x;
}

// Value `i` (row-major over rows of `cols_padded`) of a Q8_1 matrix; the whole warp calls it
// for 32 consecutive, block-aligned values (zeros past a row's `cols`).
__device__ __forceinline__ void quantize_q8_1(q8_1_block *__restrict__ q8, size_t i, float v) {
    const float amax = warp_max(fabsf(v));
    const float sum = warp_sum(v);
    const float d = amax / 127.0f;
    q8_1_block *b = q8 + i / 32;
    b->qs[i % 32] = (amax == 0.0f) ? 0 : (int8_t)roundf(v / d);
    if (i % 32 == 0) {
        b->d = __float2half(d);
        b->s = __float2half(sum);
    }
}

// ---------------------------------------------------------------------------------------------
// RMSNorm (twins: fast::twin::norm::{add, rms_norm}, fast::twin::q8_1). One block per row.
// With `y`, the residual add `x += y` first (add_f32's arithmetic); with `q8`, the normed rows
// also quantized to Q8_1 rows of `cols_padded` values (`cols_padded` a multiple of blockDim.x,
// so every warp takes part in every block's reductions).
// ---------------------------------------------------------------------------------------------

extern "C" __global__ void rms_norm(float *__restrict__ x, const float *__restrict__ y,
                                    const float *__restrict__ w, float *__restrict__ out,
                                    q8_1_block *__restrict__ q8, int cols, int cols_padded,
                                    float eps) {
    GRID_DEPENDENCY();
    const size_t row = blockIdx.x;
    float *xr = x + row * cols;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = xr[c];
        if (y != nullptr) {
            v += y[row * cols + c];
            xr[c] = v;
        }
        ss += v * v;
    }
    ss = block_sum(ss);
    const float scale = rsqrtf(ss / (float)cols + eps);
    const int end = q8 != nullptr ? cols_padded : cols;
    for (int c = threadIdx.x; c < end; c += blockDim.x) {
        float h = 0.0f;
        if (c < cols) {
            h = xr[c] * scale * w[c];
            out[row * cols + c] = h;
        }
        if (q8 != nullptr) quantize_q8_1(q8, row * cols_padded + c, h);
    }
}

// ---------------------------------------------------------------------------------------------
// Element-wise steps (twins: fast::twin::norm::{add, silu_mul}).
// ---------------------------------------------------------------------------------------------

extern "C" __global__ void add_f32(float *__restrict__ x, const float *__restrict__ y, int n) {
    GRID_DEPENDENCY();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

extern "C" __global__ void silu_mul(float *__restrict__ gate, const float *__restrict__ up, int n) {
    GRID_DEPENDENCY();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float g = gate[i];
        gate[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

// silu_mul over rows of `cols`, then the rows quantized to Q8_1 rows of `cols_padded` values
// (twins: fast::twin::norm::silu_mul, fast::twin::q8_1). Grid (cols_padded / blockDim.x, rows).
extern "C" __global__ void silu_mul_q8_1(float *__restrict__ gate, const float *__restrict__ up,
                                         q8_1_block *__restrict__ q8, int cols, int cols_padded) {
    GRID_DEPENDENCY();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const size_t row = blockIdx.y;
    float v = 0.0f;
    if (c < cols) {
        const size_t i = row * cols + c;
        const float g = gate[i];
        v = g / (1.0f + expf(-g)) * up[i];
        gate[i] = v;
    }
    if (c < cols_padded) quantize_q8_1(q8, row * cols_padded + c, v);
}

// Rows of `cols` values quantized to Q8_1 rows of `cols_padded` (twin: fast::twin::q8_1), for a
// matvec whose input no kernel quantized in place: candle's quantize_q8_1 arithmetic, in a
// kernel that takes part in programmatic dependent launch. Grid (cols_padded / blockDim.x, rows).
extern "C" __global__ void quantize_rows_q8_1(const float *__restrict__ x, q8_1_block *__restrict__ q8,
                                              int cols, int cols_padded) {
    GRID_DEPENDENCY();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const size_t row = blockIdx.y;
    const float v = c < cols ? x[row * cols + c] : 0.0f;
    if (c < cols_padded) quantize_q8_1(q8, row * cols_padded + c, v);
}

// `out[i] = x[rows[i]]`, rows of `cols` values; one block per output row.
extern "C" __global__ void gather_rows(const float *__restrict__ x, const uint32_t *__restrict__ rows,
                                       float *__restrict__ out, int cols) {
    GRID_DEPENDENCY();
    const size_t i = blockIdx.x;
    const float *src = x + (size_t)rows[i] * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) out[i * cols + c] = src[c];
}

// ---------------------------------------------------------------------------------------------
// Decode matrix-vector products of our own (twin: fast::twin::matvec), in place of candle's MMVQ
// for steps of up to MATVEC_MAX_ROWS activation rows. One warp per weight row; the row's
// nb x S units (block, slice), S the slices of llama.cpp's vec_dot_<type>_q8_1, are taken by
// lane l as l, l + 32, ... in order; each unit's value is added to the lane's accumulator of
// every activation row, and the lanes are summed in a butterfly (lane 0 writes). Every float
// operation is spelled __fmul_rn/__fadd_rn/__fsub_rn, so nothing is contracted into an FMA and
// the twin performs the same operations in the same order. A row's outputs do not depend on the
// other rows of the launch nor on their number: one row class for 1 to 8 rows, so a decode
// row verifying up to 7 drafts is summed as the lone decode row is.
// ---------------------------------------------------------------------------------------------

#define MATVEC_MAX_ROWS 8
#define MATVEC_WARPS 4
#define SWIGLU_WARPS 8

// Little-endian int at p, for blocks aligned to 4 bytes (A4) or only to 2.
template <bool A4>
__device__ __forceinline__ int ld_int(const uint8_t *p) {
    if (A4) return *(const int *)p;
    const uint16_t *h = (const uint16_t *)p;
    return (int)((uint32_t)h[0] | ((uint32_t)h[1] << 16));
}

// Int i (values 4i .. 4i + 3) of a Q8_1 block's quants.
__device__ __forceinline__ int q8_int(const q8_1_block *y, int i) {
    return *(const int *)(y->qs + 4 * i);
}

__device__ __forceinline__ float q8_d(const q8_1_block *y) { return __half2float(y->d); }
__device__ __forceinline__ float q8_s(const q8_1_block *y) { return __half2float(y->s); }
__device__ __forceinline__ float half_at(const uint8_t *p) {
    return __half2float(*(const half *)p);
}

// The twin's `sums` step: sd += d8 * dot, sm += d8 * min, each rounded.
__device__ __forceinline__ void add_group(float &sd, float &sm, float d8, int dot, int mn) {
    sd = __fadd_rn(sd, __fmul_rn(d8, (float)dot));
    sm = __fadd_rn(sm, __fmul_rn(d8, (float)mn));
}

// Slices of a Q4_0/Q4_1 block (2: iqs = 2s) and a Q5_0/Q5_1 block (2); integer sums.
template <bool A4>
__device__ __forceinline__ int sumi_q4(const uint8_t *qs, const q8_1_block *y, int s) {
    const int iqs = 2 * s;
    int sumi = 0;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int v = ld_int<A4>(qs + 4 * (iqs + i));
        sumi = __dp4a(v & 0x0F0F0F0F, q8_int(y, iqs + i), sumi);
        sumi = __dp4a((v >> 4) & 0x0F0F0F0F, q8_int(y, iqs + i + 4), sumi);
    }
    return sumi;
}

template <bool A4>
__device__ __forceinline__ int sumi_q5(const uint8_t *qh, const uint8_t *qs, const q8_1_block *y,
                                       int s) {
    const int iqs = 2 * s;
    int sumi = 0;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int vl = ld_int<A4>(qs + 4 * (iqs + i));
        const int vh = ld_int<A4>(qh) >> (4 * (iqs + i));
        int vi0 = vl & 0x0F0F0F0F;
        vi0 |= (vh << 4) & 0x00000010;
        vi0 |= (vh << 11) & 0x00001000;
        vi0 |= (vh << 18) & 0x00100000;
        vi0 |= (vh << 25) & 0x10000000;
        sumi = __dp4a(vi0, q8_int(y, iqs + i), sumi);
        int vi1 = (vl >> 4) & 0x0F0F0F0F;
        vi1 |= (vh >> 12) & 0x00000010;
        vi1 |= (vh >> 5) & 0x00001000;
        vi1 |= (vh << 2) & 0x00100000;
        vi1 |= (vh << 9) & 0x10000000;
        sumi = __dp4a(vi1, q8_int(y, iqs + i + 4), sumi);
    }
    return sumi;
}

__device__ __forceinline__ float mv_q4_0(const uint8_t *b, const q8_1_block *y, int s) {
    const float sumi = (float)sumi_q4<false>(b + 2, y, s);
    return __fmul_rn(half_at(b), __fsub_rn(__fmul_rn(sumi, q8_d(y)), __fmul_rn(4.0f, q8_s(y))));
}

__device__ __forceinline__ float mv_q4_1(const uint8_t *b, const q8_1_block *y, int s) {
    const float sumi = (float)sumi_q4<true>(b + 4, y, s);
    return __fadd_rn(__fmul_rn(sumi, __fmul_rn(half_at(b), q8_d(y))),
                     __fmul_rn(__fmul_rn(half_at(b + 2), q8_s(y)), 0.5f));
}

__device__ __forceinline__ float mv_q5_0(const uint8_t *b, const q8_1_block *y, int s) {
    const float sumi = (float)sumi_q5<false>(b + 2, b + 6, y, s);
    return __fmul_rn(half_at(b), __fsub_rn(__fmul_rn(sumi, q8_d(y)), __fmul_rn(8.0f, q8_s(y))));
}

__device__ __forceinline__ float mv_q5_1(const uint8_t *b, const q8_1_block *y, int s) {
    const float sumi = (float)sumi_q5<true>(b + 4, b + 8, y, s);
    return __fadd_rn(__fmul_rn(sumi, __fmul_rn(half_at(b), q8_d(y))),
                     __fmul_rn(__fmul_rn(half_at(b + 2), q8_s(y)), 0.5f));
}

__device__ __forceinline__ float mv_q8_0(const uint8_t *b, const q8_1_block *y, int s) {
    const int iqs = 2 * s;
    int sumi = 0;
#pragma unroll
    for (int i = 0; i < 2; i++) sumi = __dp4a(ld_int<false>(b + 2 + 4 * (iqs + i)), q8_int(y, iqs + i), sumi);
    return __fmul_rn((float)sumi, __fmul_rn(half_at(b), q8_d(y)));
}

__device__ __forceinline__ float mv_q2_k(const uint8_t *b, const q8_1_block *y, int iqs) {
    const uint8_t *scales = b, *qs = b + 16;
    const int bq8_offset = 4 * (iqs / 8);
    const int scale_offset = iqs - iqs % 8 + (iqs % 8) / 4;
    const int v = ld_int<true>(qs + 4 * iqs);
    float sd = 0.0f, sm = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const q8_1_block *y8 = y + bq8_offset + i;
        const int u = q8_int(y8, iqs % 8);
        const int sc = scales[scale_offset + 2 * i];
        const int vi = (v >> (2 * i)) & 0x03030303;
        int m = sc >> 4;
        m |= m << 8;
        m |= m << 16;
        add_group(sd, sm, q8_d(y8), __dp4a(vi, u, 0) * (sc & 0xF), __dp4a(m, u, 0));
    }
    return __fsub_rn(__fmul_rn(half_at(b + 80), sd), __fmul_rn(half_at(b + 82), sm));
}

__device__ __forceinline__ float mv_q3_k(const uint8_t *b, const q8_1_block *y, int iqs) {
    const uint8_t *hmask = b, *qs = b + 32, *scales = b + 96;
    const int bq8_offset = 4 * (iqs / 8);
    const int scale_offset = iqs - iqs % 8 + (iqs % 8) / 4;
    const int vl = ld_int<false>(qs + 4 * iqs);
    const int vh = (~ld_int<false>(hmask + 4 * (iqs % 8))) >> bq8_offset;
    float sd = 0.0f, sm = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const q8_1_block *y8 = y + bq8_offset + i;
        const int u = q8_int(y8, iqs % 8);
        const int isc = scale_offset + 2 * i;
        const int sc_low = (scales[isc % 8] >> (4 * (isc / 8))) & 0xF;
        const int sc_high = ((scales[8 + isc % 4] >> (2 * (isc / 4))) & 3) << 4;
        const int sc = (sc_low | sc_high) - 32;
        const int vil = (vl >> (2 * i)) & 0x03030303;
        const int vih = ((vh >> i) << 2) & 0x04040404;
        add_group(sd, sm, q8_d(y8), __dp4a((int)__vsubss4(vil, vih), u, 0) * sc, 0);
    }
    return __fmul_rn(half_at(b + 108), sd);
}

// get_scale_min_k4 for sub-blocks 2j, 2j + 1, on 16-bit words.
__device__ __forceinline__ void scale_min_pair(const uint8_t *scales, int j, int sc[2], int m[2]) {
    const uint16_t *s = (const uint16_t *)scales;
    uint16_t aux0, aux1;
    if (j < 2) {
        aux0 = s[j] & 0x3f3f;
        aux1 = s[j + 2] & 0x3f3f;
    } else {
        aux0 = (s[j + 2] & 0x0f0f) | ((s[j - 2] & 0xc0c0) >> 2);
        aux1 = ((s[j + 2] >> 4) & 0x0f0f) | ((s[j] & 0xc0c0) >> 2);
    }
    sc[0] = aux0 & 0xff;
    sc[1] = aux0 >> 8;
    m[0] = aux1 & 0xff;
    m[1] = aux1 >> 8;
}

__device__ __forceinline__ float mv_q4_k(const uint8_t *b, const q8_1_block *y, int s) {
    const uint8_t *scales = b + 4, *qs = b + 16;
    const int iqs = 2 * s;
    const int bq8_offset = 2 * ((iqs / 2) / 4);
    const int l = (iqs / 2) % 4;
    const int q4 = 16 * bq8_offset + 4 * l;
    const int v0 = ld_int<true>(qs + q4), v1 = ld_int<true>(qs + q4 + 16);
    int sc[2], m[2];
    scale_min_pair(scales, bq8_offset / 2, sc, m);
    float sd = 0.0f, sm = 0.0f;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const q8_1_block *y8 = y + bq8_offset + i;
        const int u0 = q8_int(y8, l), u1 = q8_int(y8, l + 4);
        const int v0i = (v0 >> (4 * i)) & 0x0F0F0F0F;
        const int v1i = (v1 >> (4 * i)) & 0x0F0F0F0F;
        const int dot1 = __dp4a(v1i, u1, __dp4a(v0i, u0, 0));
        const int dot2 = __dp4a(0x01010101, u1, __dp4a(0x01010101, u0, 0));
        add_group(sd, sm, q8_d(y8), dot1 * sc[i], dot2 * m[i]);
    }
    return __fsub_rn(__fmul_rn(half_at(b), sd), __fmul_rn(half_at(b + 2), sm));
}

__device__ __forceinline__ float mv_q5_k(const uint8_t *b, const q8_1_block *y, int s) {
    const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + 48;
    const int iqs = 2 * s;
    const int bq8_offset = 2 * ((iqs / 2) / 4);
    const int l = (iqs / 2) % 4;
    const int ql = 16 * bq8_offset + 4 * l;
    const int vl0 = ld_int<true>(qs + ql), vl1 = ld_int<true>(qs + ql + 16);
    const int vh0 = ld_int<true>(qh + 4 * l) >> bq8_offset;
    const int vh1 = ld_int<true>(qh + 4 * l + 16) >> bq8_offset;
    int sc[2], m[2];
    scale_min_pair(scales, bq8_offset / 2, sc, m);
    float sd = 0.0f, sm = 0.0f;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const q8_1_block *y8 = y + bq8_offset + i;
        const int u0 = q8_int(y8, l), u1 = q8_int(y8, l + 4);
        const int v0i = ((vl0 >> (4 * i)) & 0x0F0F0F0F) | (((vh0 >> i) << 4) & 0x10101010);
        const int v1i = ((vl1 >> (4 * i)) & 0x0F0F0F0F) | (((vh1 >> i) << 4) & 0x10101010);
        const int dot1 = __dp4a(v0i, u0, __dp4a(v1i, u1, 0));
        const int dot2 = __dp4a(0x01010101, u0, __dp4a(0x01010101, u1, 0));
        add_group(sd, sm, q8_d(y8), dot1 * sc[i], dot2 * m[i]);
    }
    return __fsub_rn(__fmul_rn(half_at(b), sd), __fmul_rn(half_at(b + 2), sm));
}

__device__ __forceinline__ float mv_q6_k(const uint8_t *b, const q8_1_block *y, int iqs) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *scales = (const int8_t *)(b + 192);
    const int bq8_offset = 4 * (iqs / 16) + (iqs % 16) / 8;
    const int scale_offset = 8 * (iqs / 16) + (iqs % 16) / 4;
    const int vh_shift = 2 * ((iqs % 16) / 8);
    const int vl = ld_int<false>(ql + 4 * iqs);
    const int vh = ld_int<false>(qh + 4 * (8 * (iqs / 16) + iqs % 8)) >> vh_shift;
    float sd = 0.0f, sm = 0.0f;
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const q8_1_block *y8 = y + bq8_offset + 2 * i;
        const int sc = scales[scale_offset + 4 * i];
        const int vil = (vl >> (4 * i)) & 0x0F0F0F0F;
        const int vih = ((vh >> (4 * i)) << 4) & 0x30303030;
        const int vi = (int)__vsubss4(vil | vih, 0x20202020);
        add_group(sd, sm, q8_d(y8), __dp4a(vi, q8_int(y8, iqs % 8), 0) * sc, 0);
    }
    return __fmul_rn(half_at(b + 208), sd);
}

// One weight row (nb blocks) against `rows` Q8_1 activation rows `y_stride` blocks apart: the
// butterfly-summed outputs in acc[0..rows) of every lane (lane 0's are the twin's).
template <float (*SLICE)(const uint8_t *, const q8_1_block *, int), int TYPE_SIZE, int QK, int S>
__device__ __forceinline__ void matvec_row(const uint8_t *__restrict__ row,
                                           const q8_1_block *__restrict__ y, int y_stride, int nb,
                                           int rows, float acc[MATVEC_MAX_ROWS]) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int r = 0; r < MATVEC_MAX_ROWS; r++) acc[r] = 0.0f;
    for (int unit = lane; unit < nb * S; unit += 32) {
        const int blk = unit / S, s = unit % S;
        const uint8_t *b = row + (size_t)blk * TYPE_SIZE;
#pragma unroll
        for (int r = 0; r < MATVEC_MAX_ROWS; r++) {
            if (r < rows) {
                acc[r] = __fadd_rn(acc[r], SLICE(b, y + (size_t)r * y_stride + blk * (QK / 32), s));
            }
        }
    }
#pragma unroll
    for (int r = 0; r < MATVEC_MAX_ROWS; r++) acc[r] = warp_sum(acc[r]);
}

// out_i[r][j] = W_i[j] . y[r] for up to three matrices of one type (Q, K and V of a layer in one
// launch; a plain matmul is one): the grid's warps run over the rows of W_0, then W_1, then W_2.
// Grid ceil((n0 + n1 + n2) / MATVEC_WARPS), block 32 * MATVEC_WARPS.
template <float (*SLICE)(const uint8_t *, const q8_1_block *, int), int TYPE_SIZE, int QK, int S>
__device__ __forceinline__ void matvec_impl(const uint8_t *w0, const uint8_t *w1, const uint8_t *w2,
                                            float *o0, float *o1, float *o2, int n0, int n1, int n2,
                                            const q8_1_block *__restrict__ y, int k, int y_stride,
                                            int rows) {
    int j = blockIdx.x * MATVEC_WARPS + threadIdx.x / 32;
    const uint8_t *w = w0;
    float *o = o0;
    int n = n0;
    if (j >= n0) {
        j -= n0;
        w = w1;
        o = o1;
        n = n1;
        if (j >= n1) {
            j -= n1;
            w = w2;
            o = o2;
            n = n2;
            if (j >= n2) return;
        }
    }
    const int nb = k / QK;
    float acc[MATVEC_MAX_ROWS];
    matvec_row<SLICE, TYPE_SIZE, QK, S>(w + (size_t)j * nb * TYPE_SIZE, y, y_stride, nb, rows, acc);
    if (threadIdx.x % 32 == 0) {
#pragma unroll
        for (int r = 0; r < MATVEC_MAX_ROWS; r++) {
            if (r < rows) o[(size_t)r * n + j] = acc[r];
        }
    }
}

// gate[r][j] = silu(Wg[j] . y[r]) * (Wu[j] . y[r]) (silu_mul's arithmetic), and the rows also
// quantized to Q8_1 rows of `cols_padded` values for the down projection (quantize_q8_1, as
// silu_mul_q8_1 writes them). Grid cols_padded / 32, block 32 * SWIGLU_WARPS: a block's 32
// outputs are one Q8_1 block of every row, each warp computing four of them.
template <float (*SLICE)(const uint8_t *, const q8_1_block *, int), int TYPE_SIZE, int QK, int S>
__device__ __forceinline__ void matvec_swiglu_impl(const uint8_t *__restrict__ wg,
                                                   const uint8_t *__restrict__ wu,
                                                   const q8_1_block *__restrict__ y,
                                                   float *__restrict__ gate,
                                                   q8_1_block *__restrict__ q8, int k, int y_stride,
                                                   int n, int cols_padded, int rows) {
    __shared__ float h[MATVEC_MAX_ROWS][32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int nb = k / QK;
    for (int t = 0; t < 32 / SWIGLU_WARPS; t++) {
        const int jl = (32 / SWIGLU_WARPS) * warp + t;
        const int j = blockIdx.x * 32 + jl;
        float g[MATVEC_MAX_ROWS], u[MATVEC_MAX_ROWS];
        if (j < n) {
            matvec_row<SLICE, TYPE_SIZE, QK, S>(wg + (size_t)j * nb * TYPE_SIZE, y, y_stride, nb,
                                                rows, g);
            matvec_row<SLICE, TYPE_SIZE, QK, S>(wu + (size_t)j * nb * TYPE_SIZE, y, y_stride, nb,
                                                rows, u);
        }
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < MATVEC_MAX_ROWS; r++) {
                h[r][jl] = (j < n && r < rows) ? g[r] / (1.0f + expf(-g[r])) * u[r] : 0.0f;
            }
        }
    }
    __syncthreads();
    for (int r = warp; r < rows; r += SWIGLU_WARPS) {
        const int j = blockIdx.x * 32 + lane;
        const float v = h[r][lane];
        if (j < n) gate[(size_t)r * n + j] = v;
        if (j < cols_padded) quantize_q8_1(q8, (size_t)r * cols_padded + j, v);
    }
}

#define MATVEC(name, type_size, qk, s)                                                            \
    extern "C" __global__ void __launch_bounds__(128, 4) matvec_##name(                \
        const uint8_t *w0, const uint8_t *w1, const uint8_t *w2, float *o0, float *o1, float *o2, \
        int n0, int n1, int n2, const q8_1_block *__restrict__ y, int k, int y_stride,            \
        int rows) {                                                                               \
        GRID_DEPENDENCY();                                                                        \
        matvec_impl<mv_##name, type_size, qk, s>(w0, w1, w2, o0, o1, o2, n0, n1, n2, y, k,        \
                                                 y_stride, rows);                                 \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(256, 2) matvec_swiglu_##name(         \
        const uint8_t *__restrict__ wg, const uint8_t *__restrict__ wu,                           \
        const q8_1_block *__restrict__ y, float *__restrict__ gate, q8_1_block *__restrict__ q8, \
        int k, int y_stride, int n, int cols_padded, int rows) {                                  \
        GRID_DEPENDENCY();                                                                        \
        matvec_swiglu_impl<mv_##name, type_size, qk, s>(wg, wu, y, gate, q8, k, y_stride, n,      \
                                                        cols_padded, rows);                       \
    }

MATVEC(q4_0, 18, 32, 2)
MATVEC(q4_1, 20, 32, 2)
MATVEC(q5_0, 22, 32, 2)
MATVEC(q5_1, 24, 32, 2)
MATVEC(q8_0, 34, 32, 4)
MATVEC(q2_k, 84, 256, 16)
MATVEC(q3_k, 110, 256, 16)
MATVEC(q4_k, 144, 256, 16)
MATVEC(q5_k, 176, 256, 16)
MATVEC(q6_k, 210, 256, 32)

// ---------------------------------------------------------------------------------------------
// RoPE and the K/V write (twins: fast::twin::rope::{rotate, write_kv}).
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ size_t arena_index(uint32_t block, int layer, int kind, int head,
                                              int slot, int layers, int kv_heads, int head_dim) {
    const size_t page = (((size_t)block * layers + layer) * 2 + kind) * kv_heads + head;
    return page * (BLOCK_POSITIONS * head_dim) + (size_t)slot * head_dim;
}

// K and V of every row into the arena at the row's slot. Grid (rows, kv_heads), block head_dim.
extern "C" __global__ void kv_write(const float *__restrict__ k, const float *__restrict__ v,
                                    const uint32_t *__restrict__ slots, half *__restrict__ arena,
                                    int layer, int layers, int kv_heads, int head_dim) {
    GRID_DEPENDENCY();
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

// RoPE on Q and K, then K and V into the arena, in one launch (twins: fast::twin::rope::{rotate,
// write_kv}): `rope`'s arithmetic on every query and key head, then `kv_write`'s stores. Grid
// (rows, heads + kv_heads), block head_dim (at least rope_dim / 2): a block y < heads rotates
// query head y; the others rotate key head y - heads and store it with its value head. RoPE
// turns adjacent pairs (2i, 2i+1), i < rope_dim / 2; cos/sin are the runner's whole table,
// [position][rope_dim / 2] (crate::rope::RopeCache), indexed by each row's position. Layers
// without RoPE store with kv_write alone.
extern "C" __global__ void rope_kv_write(float *__restrict__ q, float *__restrict__ k,
                                         const float *__restrict__ v,
                                         const float *__restrict__ cos_t,
                                         const float *__restrict__ sin_t,
                                         const uint32_t *__restrict__ positions,
                                         const uint32_t *__restrict__ slots,
                                         half *__restrict__ arena, int heads, int kv_heads,
                                         int head_dim, int rope_dim, int layer, int layers) {
    GRID_DEPENDENCY();
    const int row = blockIdx.x, i = threadIdx.x;
    const bool query = (int)blockIdx.y < heads;
    const int head = query ? blockIdx.y : blockIdx.y - heads;
    float *h = query ? q + ((size_t)row * heads + head) * head_dim
                     : k + ((size_t)row * kv_heads + head) * head_dim;
    const int half_dim = rope_dim / 2;
    if (i < half_dim) {
        // The whole table, [position][half_dim]: the row's by its position.
        const size_t at = (size_t)positions[row] * half_dim + i;
        const float c = cos_t[at], s = sin_t[at];
        const float a = h[2 * i], b = h[2 * i + 1];
        h[2 * i] = a * c - b * s;
        h[2 * i + 1] = a * s + b * c;
    }
    if (query) return;  // the whole block: y is the block's
    __syncthreads();    // the rotated key, written by pairs, is read by dimension below
    const uint32_t slot = slots[row];
    if (slot == SKIP_SLOT || i >= head_dim) return;
    const size_t src = ((size_t)row * kv_heads + head) * head_dim + i;
    const uint32_t block = slot / BLOCK_POSITIONS;
    const int at = slot % BLOCK_POSITIONS;
    arena[arena_index(block, layer, 0, head, at, layers, kv_heads, head_dim) + i] = __float2half(k[src]);
    arena[arena_index(block, layer, 1, head, at, layers, kv_heads, head_dim) + i] = __float2half(v[src]);
}

// ---------------------------------------------------------------------------------------------
// Paged attention (twin: fast::twin::attention). One block per (row, KV head, split): the
// `group` query heads sharing the KV head are computed together, each key and value row read
// once for all of them. Keys in blocks of 16 positions, online softmax; a decode row (its
// sequence has one new row) over more than MIN_SPLIT_POSITIONS positions is split along the context
// and `attention_merge` combines the splits. Block: 128 threads (4 warps); head_dim <= 256.
// ---------------------------------------------------------------------------------------------

// Positions per split of a decode row seeing `visible` positions (twin:
// fast::twin::attention::split_positions): 64, or past 2,048 the multiple of 16 that makes at
// most MAX_SPLITS splits.
__device__ __forceinline__ int split_positions(int visible) {
    int per = (visible + MAX_SPLITS - 1) / MAX_SPLITS;
    per = (per + BLOCK_POSITIONS - 1) / BLOCK_POSITIONS * BLOCK_POSITIONS;
    return max(MIN_SPLIT_POSITIONS, per);
}

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
    int layers, int heads, int kv_heads, int head_dim, int flash_rows) {
    __shared__ float q_s[GROUP * MAX_HEAD_DIM];
    __shared__ float scores[GROUP * BLOCK_POSITIONS];
    const int row = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z;
    const SeqInfo seq = seqs[row_seq[row]];
    if ((int64_t)seq.rows >= (int64_t)flash_rows) return;  // flash_prefill's row
    const int r = row - (int)seq.row0;
    const int visible = (int)seq.past + r + 1;
    const int per = split_positions(visible);
    const int n_splits = seq.rows == 1 ? (visible + per - 1) / per : 1;
    if (split >= n_splits) return;
    const int from = split * per;
    const int to = n_splits == 1 ? visible : min((split + 1) * per, visible);
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
        int layers, int heads, int kv_heads, int head_dim, int flash_rows) {                     \
        GRID_DEPENDENCY();                                                                       \
        attention_partial_impl<G>(q, arena, row_seq, seqs, block_tables, max_blocks, part_max,   \
                                  part_sum, part_out, max_splits, layer, layers, heads,          \
                                  kv_heads, head_dim, flash_rows);                               \
    }

ATTENTION_PARTIAL(1)
ATTENTION_PARTIAL(2)
ATTENTION_PARTIAL(3)
ATTENTION_PARTIAL(4)
ATTENTION_PARTIAL(5)
ATTENTION_PARTIAL(6)
ATTENTION_PARTIAL(7)
ATTENTION_PARTIAL(8)

// Rows of sequences of at least `flash_rows` rows are flash_prefill's: both kernels leave them
// (INT_MAX: none are).

// Combines a row's splits per head, in split order (twin: fast::twin::attention::merge).
// Grid (rows, heads), block head_dim. With `q8`, the output rows also quantized to Q8_1 rows of
// `cols_padded` values (twin: fast::twin::q8_1) for the MMVQ output projection: the caller
// passes it only when heads × head_dim is its own padding and head_dim a multiple of 32, so
// every warp quantizes one whole block.
extern "C" __global__ void attention_merge(
    const uint32_t *__restrict__ row_seq, const SeqInfo *__restrict__ seqs,
    const float *__restrict__ part_max, const float *__restrict__ part_sum,
    const float *__restrict__ part_out, float *__restrict__ out, q8_1_block *__restrict__ q8,
    int cols_padded, int max_splits, int heads, int head_dim, int flash_rows) {
    GRID_DEPENDENCY();
    const int row = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
    if (d >= head_dim) return;
    const SeqInfo seq = seqs[row_seq[row]];
    if ((int64_t)seq.rows >= (int64_t)flash_rows) return;  // flash_prefill's row
    const int visible = (int)seq.past + (row - (int)seq.row0) + 1;
    const int per = split_positions(visible);
    const int n_splits = seq.rows == 1 ? (visible + per - 1) / per : 1;
    const size_t base = ((size_t)row * heads + head) * max_splits;
    float max = -INFINITY;
    for (int s = 0; s < n_splits; ++s) max = fmaxf(max, part_max[base + s]);
    float sum = 0.0f, acc = 0.0f;
    for (int s = 0; s < n_splits; ++s) {
        const float w = expf(part_max[base + s] - max);
        sum += part_sum[base + s] * w;
        acc += part_out[(base + s) * head_dim + d] * w;
    }
    const float o = acc / sum;
    out[((size_t)row * heads + head) * head_dim + d] = o;
    if (q8 != nullptr) quantize_q8_1(q8, (size_t)row * cols_padded + (size_t)head * head_dim + d, o);
}

// ---------------------------------------------------------------------------------------------
// Decode attention (twin: fast::twin::attention::{decode_partial, merge}, the contract of attention_partial and
// attention_merge together): the rows of one-row sequences, head dimension D of 64 or 128.
// One block per (row, KV head, split), 4 warps. Each lane holds 8 dimensions of the GROUP
// queries in registers (scaled by 1 / sqrt(D)) and reads K and V 16 bytes at a time: D / 8 lanes
// share a key, so a warp takes 32 / (D / 8) keys at once. Per block of 16 positions the scores go
// to shared memory, then one thread per (head, key) takes the softmax's exponential and the
// running max and sum move once per head, then the V rows are added with those weights. A row
// over several splits writes its partials, and the last of its blocks to finish (a counter per
// (row, KV head), which that block resets) merges them in split order as attention_merge does
// and writes the row's output and, with `q8`, its Q8_1 rows: no merge launch. Rows of longer
// sequences are flash_prefill's: this kernel leaves them.
// ---------------------------------------------------------------------------------------------

#define DECODE_WARPS 4

// Eight f16 values (16 bytes, aligned) as floats.
__device__ __forceinline__ void load8(const half *p, float f[8]) {
    const uint4 raw = *(const uint4 *)p;
    const half2 *h2 = (const half2 *)&raw;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float2 v = __half22float2(h2[j]);
        f[2 * j] = v.x;
        f[2 * j + 1] = v.y;
    }
}

// Value `d` of query head `head` of `row`'s attention output, and with `q8` its Q8_1 rows (the
// warp's 32 consecutive values one block).
__device__ __forceinline__ void put_attention(float *__restrict__ out, q8_1_block *__restrict__ q8,
                                              size_t row, int heads, int head, int D, int d,
                                              int cols_padded, float v) {
    out[((size_t)row * heads + head) * D + d] = v;
    if (q8 != nullptr) quantize_q8_1(q8, row * cols_padded + (size_t)head * D + d, v);
}

template <int D, int GROUP>
__device__ void attention_decode_impl(
    const float *__restrict__ q, const half *__restrict__ arena,
    const uint32_t *__restrict__ row_seq, const SeqInfo *__restrict__ seqs,
    const uint32_t *__restrict__ block_tables, int max_blocks, float *__restrict__ part_max,
    float *__restrict__ part_sum, float *__restrict__ part_out, uint32_t *__restrict__ counters,
    float *__restrict__ out, q8_1_block *__restrict__ q8, int cols_padded, int max_splits,
    int layer, int layers, int heads, int kv_heads) {
    constexpr int L = D / 8;      // lanes sharing a key
    constexpr int KPW = 32 / L;   // keys a warp takes at once
    constexpr int STRIDE = DECODE_WARPS * KPW;
    static_assert(BLOCK_POSITIONS % STRIDE == 0, "every lane takes as many keys");
    __shared__ float scores[GROUP][BLOCK_POSITIONS];
    __shared__ float probs[GROUP][BLOCK_POSITIONS];
    __shared__ float factor_s[GROUP], run_max[GROUP], run_sum[GROUP];
    __shared__ float o_s[DECODE_WARPS][GROUP][D];
    __shared__ bool last_s;
    const int row = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z;
    const SeqInfo seq = seqs[row_seq[row]];
    if (seq.rows != 1) return;  // flash_prefill's row
    const int visible = (int)seq.past + 1;
    const int per = split_positions(visible);
    const int n_splits = (visible + per - 1) / per;
    if (split >= n_splits) return;
    const int from = split * per, to = min(from + per, visible);
    const uint32_t *blocks = block_tables + (size_t)seq.index * max_blocks;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int sub = lane % L, slot = lane / L;
    const float scale = rsqrtf((float)D);
    float qr[GROUP][8], o[GROUP][8];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        const float *qh = q + ((size_t)row * heads + kv_head * GROUP + g) * D + 8 * sub;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            qr[g][j] = qh[j] * scale;
            o[g][j] = 0.0f;
        }
    }
    if (threadIdx.x < GROUP) {
        run_max[threadIdx.x] = -INFINITY;
        run_sum[threadIdx.x] = 0.0f;
    }
    for (int pos = from; pos < to; pos += BLOCK_POSITIONS) {
        const uint32_t block = blocks[pos / BLOCK_POSITIONS];
        const int n = min(BLOCK_POSITIONS, to - pos);
        const half *kb = arena + arena_index(block, layer, 0, kv_head, 0, layers, kv_heads, D);
        const half *vb = arena + arena_index(block, layer, 1, kv_head, 0, layers, kv_heads, D);
        // Scores: the D / 8 lanes of a key each take 8 dimensions, then add theirs up.
#pragma unroll
        for (int key = warp * KPW + slot; key < BLOCK_POSITIONS; key += STRIDE) {
            float kf[8];
            load8(kb + (size_t)key * D + 8 * sub, kf);
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                float s = 0.0f;
#pragma unroll
                for (int j = 0; j < 8; ++j) s += qr[g][j] * kf[j];
#pragma unroll
                for (int m = L / 2; m > 0; m >>= 1) s += __shfl_xor_sync(0xffffffff, s, m);
                if (sub == 0) scores[g][key] = key < n ? s : -INFINITY;
            }
        }
        __syncthreads();
        // The softmax, once per (head, key): thread g * 16 + key; the running max and sum move
        // once per head (its key 0's thread).
        {
            const int g = threadIdx.x / BLOCK_POSITIONS, key = threadIdx.x % BLOCK_POSITIONS;
            const bool mine = g < GROUP;
            const float s = mine ? scores[g][key] : -INFINITY;
            const float old = mine ? run_max[g] : -INFINITY;
            float top = s;
#pragma unroll
            for (int m = BLOCK_POSITIONS / 2; m > 0; m >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, m));
            const float new_max = fmaxf(old, top);
            const float p = s == -INFINITY ? 0.0f : expf(s - new_max);
            float sum = p;
#pragma unroll
            for (int m = BLOCK_POSITIONS / 2; m > 0; m >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, m);
            // Every lane has read the old max and sum before key 0's lane replaces them.
            __syncwarp();
            if (mine) {
                probs[g][key] = p;
                if (key == 0) {
                    const float f = old == -INFINITY ? 0.0f : expf(old - new_max);
                    factor_s[g] = f;
                    run_sum[g] = run_sum[g] * f + sum;
                    run_max[g] = new_max;
                }
            }
        }
        __syncthreads();
        // The V rows with those weights, 16 bytes a lane.
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            const float f = factor_s[g];
#pragma unroll
            for (int j = 0; j < 8; ++j) o[g][j] *= f;
        }
        for (int key = warp * KPW + slot; key < n; key += STRIDE) {
            float vf[8];
            load8(vb + (size_t)key * D + 8 * sub, vf);
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                const float p = probs[g][key];
#pragma unroll
                for (int j = 0; j < 8; ++j) o[g][j] += p * vf[j];
            }
        }
    }
    // The lanes holding the same dimensions (a warp's key slots), then the warps.
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
            for (int m = L; m < 32; m <<= 1) o[g][j] += __shfl_xor_sync(0xffffffff, o[g][j], m);
            if (slot == 0) o_s[warp][g][8 * sub + j] = o[g][j];
        }
    }
    __syncthreads();
    const size_t head0 = (size_t)row * heads + (size_t)kv_head * GROUP;
    // Each warp takes 32 consecutive (head, dimension) values, one Q8_1 block when quantizing.
    if (n_splits == 1) {
        for (int i = threadIdx.x; i < GROUP * D; i += blockDim.x) {
            const int g = i / D, d = i % D;
            float acc = 0.0f;
#pragma unroll
            for (int w = 0; w < DECODE_WARPS; ++w) acc += o_s[w][g][d];
            put_attention(out, q8, row, heads, kv_head * GROUP + g, D, d, cols_padded, acc / run_sum[g]);
        }
        return;
    }
    for (int i = threadIdx.x; i < GROUP * D; i += blockDim.x) {
        const int g = i / D, d = i % D;
        float acc = 0.0f;
#pragma unroll
        for (int w = 0; w < DECODE_WARPS; ++w) acc += o_s[w][g][d];
        const size_t at = (head0 + g) * max_splits + split;
        part_out[at * D + d] = acc;
        if (d == 0) {
            part_max[at] = run_max[g];
            part_sum[at] = run_sum[g];
        }
    }
    // The last block of the row's splits to finish merges them.
    __threadfence();
    __syncthreads();
    uint32_t *counter = counters + (size_t)row * kv_heads + kv_head;
    if (threadIdx.x == 0) last_s = atomicAdd(counter, 1u) == (uint32_t)(n_splits - 1);
    __syncthreads();
    if (!last_s) return;
    __threadfence();
    for (int i = threadIdx.x; i < GROUP * D; i += blockDim.x) {
        const int g = i / D, d = i % D;
        const size_t base = (head0 + g) * max_splits;
        float max = -INFINITY;
        for (int s = 0; s < n_splits; ++s) max = fmaxf(max, __ldcg(part_max + base + s));
        float sum = 0.0f, acc = 0.0f;
        for (int s = 0; s < n_splits; ++s) {
            const float w = expf(__ldcg(part_max + base + s) - max);
            sum += __ldcg(part_sum + base + s) * w;
            acc += __ldcg(part_out + (base + s) * D + d) * w;
        }
        put_attention(out, q8, row, heads, kv_head * GROUP + g, D, d, cols_padded, acc / sum);
    }
    if (threadIdx.x == 0) *counter = 0;
}

#define ATTENTION_DECODE(D, G)                                                                   \
    extern "C" __global__ void __launch_bounds__(128, 2) attention_decode_d##D##_g##G(             \
        const float *__restrict__ q, const half *__restrict__ arena,                             \
        const uint32_t *__restrict__ row_seq, const SeqInfo *__restrict__ seqs,                  \
        const uint32_t *__restrict__ block_tables, int max_blocks, float *__restrict__ part_max, \
        float *__restrict__ part_sum, float *__restrict__ part_out,                              \
        uint32_t *__restrict__ counters, float *__restrict__ out, q8_1_block *__restrict__ q8,   \
        int cols_padded, int max_splits, int layer, int layers, int heads, int kv_heads) {       \
        GRID_DEPENDENCY();                                                                       \
        attention_decode_impl<D, G>(q, arena, row_seq, seqs, block_tables, max_blocks,          \
                                    part_max, part_sum, part_out, counters, out, q8,             \
                                    cols_padded, max_splits, layer, layers, heads, kv_heads);    \
    }

ATTENTION_DECODE(64, 1)
ATTENTION_DECODE(64, 2)
ATTENTION_DECODE(64, 3)
ATTENTION_DECODE(64, 4)
ATTENTION_DECODE(64, 5)
ATTENTION_DECODE(64, 6)
ATTENTION_DECODE(64, 7)
ATTENTION_DECODE(64, 8)
ATTENTION_DECODE(128, 1)
ATTENTION_DECODE(128, 2)
ATTENTION_DECODE(128, 3)
ATTENTION_DECODE(128, 4)
ATTENTION_DECODE(128, 5)
ATTENTION_DECODE(128, 6)
ATTENTION_DECODE(128, 7)
ATTENTION_DECODE(128, 8)

// ---------------------------------------------------------------------------------------------
// Tensor-core prefill attention (twin: fast::twin::flash, which states the contract). One block
// per (tile, KV head): a tile is FLASH_PAIRS consecutive (row, query head) pairs of one
// sequence, pairs counted row x group + head, so a row's GQA heads sit side by side in the M
// dimension; warp w holds pairs 16w..16w+15 as the rows of its m16n8k16 products. Keys and values
// are staged FLASH_KEYS at a time (page by page through the block table) into shared memory;
// S = Q K^T and O += P V are f16 mma.sync with f32 accumulators; the online softmax runs in the
// accumulators' registers (a row's 16 keys of an n8 pair live in one quad of lanes). The block
// stops at the last position its last row sees; a warp skips the products of a chunk all of its
// rows are masked from.
// Fragment layouts (PTX ISA, mma.m16n8k16 .f16): lane = 4 * gid + tig; A regs hold (row gid or
// gid + 8, columns 2 tig + {0,1} or + 8); B regs (k = 2 tig + {0,1} or + 8, n = gid); C regs
// (row gid or gid + 8, n = 2 tig + {0,1}). An S accumulator pair of n8 tiles is therefore
// exactly the A fragment of P for the next product, converted to f16 in registers.
// ---------------------------------------------------------------------------------------------

#define FLASH_THREADS 128
#define FLASH_PAIRS (16 * FLASH_THREADS / 32)
#define FLASH_KEYS 64
#define FLASH_PAD 8  // halves per shared row: 16-byte aligned rows, conflict-free fragment reads

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t *>(&h);
}

__device__ __forceinline__ void mma_f16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                              uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// B fragments of V (k = key, n = dimension) from its row-major [key][dim] tile: ldmatrix with
// .trans, lanes 0-15 giving the 16 keys' row addresses at column n0.
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t &b0, uint32_t &b1, const half *row) {
    const uint32_t at = (uint32_t)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(b0), "=r"(b1)
                 : "r"(at));
}

template <int HD>
__device__ void flash_prefill_impl(const float *__restrict__ q, const half *__restrict__ arena,
                                   const SeqInfo *__restrict__ seqs,
                                   const uint32_t *__restrict__ block_tables, int max_blocks,
                                   const uint32_t *__restrict__ tiles, float *__restrict__ out,
                                   int layer, int layers, int heads, int kv_heads) {
    __shared__ __align__(16) half k_s[FLASH_KEYS][HD + FLASH_PAD];
    __shared__ __align__(16) half v_s[FLASH_KEYS][HD + FLASH_PAD];
    const int kv_head = blockIdx.y;
    const SeqInfo seq = seqs[tiles[2 * blockIdx.x]];
    const int pair0 = (int)tiles[2 * blockIdx.x + 1];
    const int group = heads / kv_heads;
    const int pairs = (int)seq.rows * group;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int gid = lane / 4, tig = lane % 4;
    const uint32_t *blocks = block_tables + (size_t)seq.index * max_blocks;

    // The thread's two rows of the products: pairs warp*16 + gid and + 8. Pairs past the
    // sequence compute as its last pair does and are not stored.
    int position[2];
    size_t at[2];
    bool stored[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int pair = pair0 + warp * 16 + gid + 8 * i;
        stored[i] = pair < pairs;
        const int p = min(pair, pairs - 1);
        const int r = p / group, h = p % group;
        position[i] = (int)seq.past + r;
        at[i] = ((size_t)(seq.row0 + r) * heads + kv_head * group + h) * HD;
    }
    const int last_pair = min(pair0 + FLASH_PAIRS, pairs) - 1;
    const int end = (int)seq.past + last_pair / group + 1;  // keys the tile sees
    const int warp_last = min(pair0 + warp * 16 + 15, pairs - 1);
    const int warp_end = (int)seq.past + warp_last / group + 1;

    // Q as A fragments, rounded to f16 once.
    uint32_t qa[HD / 16][4];
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
        const int c = kk * 16 + 2 * tig;
        qa[kk][0] = pack_half2(q[at[0] + c], q[at[0] + c + 1]);
        qa[kk][1] = pack_half2(q[at[1] + c], q[at[1] + c + 1]);
        qa[kk][2] = pack_half2(q[at[0] + c + 8], q[at[0] + c + 9]);
        qa[kk][3] = pack_half2(q[at[1] + c + 8], q[at[1] + c + 9]);
    }
    float o[HD / 8][4];
#pragma unroll
    for (int t = 0; t < HD / 8; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    const float scale_log2 = rsqrtf((float)HD) * 1.4426950408889634f;

    for (int c0 = 0; c0 < end; c0 += FLASH_KEYS) {
        const int n = min(FLASH_KEYS, end - c0);
        __syncthreads();  // the previous chunk's readers are done
        // Stage: 16-byte pieces, a key's row read whole by consecutive threads; keys past the
        // tile's end are zeros (and masked below).
        for (int i = threadIdx.x; i < FLASH_KEYS * (HD / 8); i += FLASH_THREADS) {
            const int key = i / (HD / 8), d = (i % (HD / 8)) * 8;
            uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
            if (key < n) {
                const int p = c0 + key;
                const uint32_t block = blocks[p / BLOCK_POSITIONS];
                const int slot = p % BLOCK_POSITIONS;
                kv = *reinterpret_cast<const uint4 *>(
                    arena + arena_index(block, layer, 0, kv_head, slot, layers, kv_heads, HD) + d);
                vv = *reinterpret_cast<const uint4 *>(
                    arena + arena_index(block, layer, 1, kv_head, slot, layers, kv_heads, HD) + d);
            }
            *reinterpret_cast<uint4 *>(&k_s[key][d]) = kv;
            *reinterpret_cast<uint4 *>(&v_s[key][d]) = vv;
        }
        __syncthreads();
        if (c0 >= warp_end) continue;  // warp-uniform: every row of the warp is masked here

        float s[FLASH_KEYS / 8][4];
#pragma unroll
        for (int t = 0; t < FLASH_KEYS / 8; ++t) {
            s[t][0] = s[t][1] = s[t][2] = s[t][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; ++kk) {
                const half *k = &k_s[t * 8 + gid][kk * 16 + 2 * tig];
                mma_f16_16816(s[t], qa[kk], *reinterpret_cast<const uint32_t *>(k),
                              *reinterpret_cast<const uint32_t *>(k + 8));
            }
        }
        // Scale into the log2 domain, mask, and take each row's max over its quad.
        float chunk_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int t = 0; t < FLASH_KEYS / 8; ++t) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = c0 + t * 8 + 2 * tig + (e & 1);
                const float v = key <= position[e >> 1] ? s[t][e] * scale_log2 : -INFINITY;
                s[t][e] = v;
                chunk_max[e >> 1] = fmaxf(chunk_max[e >> 1], v);
            }
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            chunk_max[i] = fmaxf(chunk_max[i], __shfl_xor_sync(0xffffffffu, chunk_max[i], 1));
            chunk_max[i] = fmaxf(chunk_max[i], __shfl_xor_sync(0xffffffffu, chunk_max[i], 2));
            const float new_max = fmaxf(m[i], chunk_max[i]);
            const float alpha = exp2f(m[i] - new_max);
            m[i] = new_max;
            l[i] *= alpha;
#pragma unroll
            for (int t = 0; t < HD / 8; ++t) {
                o[t][2 * i] *= alpha;
                o[t][2 * i + 1] *= alpha;
            }
        }
#pragma unroll
        for (int t = 0; t < FLASH_KEYS / 8; ++t) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = exp2f(s[t][e] - m[e >> 1]);
                s[t][e] = p;
                l[e >> 1] += p;
            }
        }
        // O += P V, sixteen keys at a time.
#pragma unroll
        for (int kt = 0; kt < FLASH_KEYS / 16; ++kt) {
            const uint32_t pa[4] = {
                pack_half2(s[2 * kt][0], s[2 * kt][1]), pack_half2(s[2 * kt][2], s[2 * kt][3]),
                pack_half2(s[2 * kt + 1][0], s[2 * kt + 1][1]),
                pack_half2(s[2 * kt + 1][2], s[2 * kt + 1][3])};
#pragma unroll
            for (int t = 0; t < HD / 8; ++t) {
                uint32_t b0, b1;
                ldmatrix_x2_trans(b0, b1, &v_s[kt * 16 + lane % 16][t * 8]);
                mma_f16_16816(o[t], pa, b0, b1);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
        if (!stored[i]) continue;
        const float inv = 1.0f / l[i];
#pragma unroll
        for (int t = 0; t < HD / 8; ++t) {
            float2 w = make_float2(o[t][2 * i] * inv, o[t][2 * i + 1] * inv);
            *reinterpret_cast<float2 *>(out + at[i] + t * 8 + 2 * tig) = w;
        }
    }
}

#define FLASH_PREFILL(D)                                                                          \
    extern "C" __global__ void __launch_bounds__(128, 2) flash_prefill_d##D(                        \
        const float *__restrict__ q, const half *__restrict__ arena,                              \
        const SeqInfo *__restrict__ seqs, const uint32_t *__restrict__ block_tables,              \
        int max_blocks, const uint32_t *__restrict__ tiles, float *__restrict__ out, int layer,   \
        int layers, int heads, int kv_heads) {                                                    \
        GRID_DEPENDENCY();                                                                        \
        flash_prefill_impl<D>(q, arena, seqs, block_tables, max_blocks, tiles, out, layer,        \
                              layers, heads, kv_heads);                                           \
    }

FLASH_PREFILL(64)
FLASH_PREFILL(128)

// ---------------------------------------------------------------------------------------------
// Sampling on the GPU (twin: fast::twin::sample, bit-exact): penalties, then one block of
// SAMPLE_THREADS threads per logit row picks the token. Thread t owns the ids of one contiguous
// chunk, so per-thread partial results in id order plus a block scan give id-ordered answers
// (top-k's ties, top-p's ties, the draw). Weights are summed in 40-bit fixed point with integer
// atomics: exact, so the order threads add in does not matter. Every float operation is written
// with the _rn intrinsics or an explicit fmaf so nvcc cannot contract it differently from the
// twin.
// ---------------------------------------------------------------------------------------------

#define SAMPLE_THREADS 512
#define NO_TOKEN 0xffffffffu

struct SampleRow {
    float temperature, inv_temperature;
    uint32_t top_k;
    float top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty;
    double uniform;
};

__device__ __forceinline__ float sanitize_logit(float l) {
    if (isnan(l)) return -INFINITY;
    if (l == INFINITY) return 3.402823466e+38f;
    return l;
}

// Penalties of each logit row: entries [n][token, count], spans [rows][start, end).
// Grid (logit rows), block 64.
extern "C" __global__ void apply_penalties(float *__restrict__ logits,
                                           const uint32_t *__restrict__ entries,
                                           const uint32_t *__restrict__ spans,
                                           const SampleRow *__restrict__ rows, int vocab) {
    GRID_DEPENDENCY();
    const int row = blockIdx.x;
    const SampleRow p = rows[row];
    const uint32_t start = spans[2 * row], end = spans[2 * row + 1];
    for (uint32_t j = start + threadIdx.x; j < end; j += blockDim.x) {
        const uint32_t token = entries[2 * j], count = entries[2 * j + 1];
        if (token >= (uint32_t)vocab) continue;
        float *l = logits + (size_t)row * vocab + token;
        float v = sanitize_logit(*l);
        v = v > 0.0f ? __fdiv_rn(v, p.repetition_penalty) : __fmul_rn(v, p.repetition_penalty);
        const float minus = __fadd_rn(__fmul_rn((float)count, p.frequency_penalty), p.presence_penalty);
        *l = __fsub_rn(v, minus);
    }
}

// e^x for x <= 0: the twin's exp_neg, constant for constant.
__device__ __forceinline__ float exp_neg(float x) {
    if (isnan(x) || x < -87.0f) return 0.0f;
    const float n = rintf(__fmul_rn(x, __uint_as_float(0x3fb8aa3bu)));
    float r = fmaf(-n, __uint_as_float(0x3f318000u), x);
    r = fmaf(-n, __uint_as_float(0xb95e8083u), r);
    float p = __uint_as_float(0x39506967u);
    p = fmaf(p, r, __uint_as_float(0x3ab743ceu));
    p = fmaf(p, r, __uint_as_float(0x3c088908u));
    p = fmaf(p, r, __uint_as_float(0x3d2aa9c1u));
    p = fmaf(p, r, __uint_as_float(0x3e2aaaaau));
    p = fmaf(p, r, __uint_as_float(0x3f000000u));
    const float r2 = __fmul_rn(r, r);
    const float y = __fadd_rn(fmaf(p, r2, r), 1.0f);
    return __fmul_rn(y, __int_as_float(((int)n + 127) << 23));
}

__device__ __forceinline__ float sample_weight(float l, float max, float inv_t) {
    const float d = __fsub_rn(l, max);
    return d == 0.0f ? 1.0f : exp_neg(__fmul_rn(d, inv_t));
}

__device__ __forceinline__ unsigned long long fixed_weight(float w) {
    return (unsigned long long)__fmul_rn(w, 1099511627776.0f);
}

__device__ __forceinline__ uint32_t order_key(float v) {
    const uint32_t b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Exclusive prefix of `v` over the block's threads in thread order, and the total. Uses
// `scratch[32]`; every thread of the block must call it.
__device__ unsigned long long block_scan(unsigned long long v, unsigned long long *scratch,
                                         unsigned long long *total) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    unsigned long long x = v;
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) scratch[warp] = x;
    __syncthreads();
    if (warp == 0) {
        unsigned long long s = lane < warps ? scratch[lane] : 0ull;
        for (int o = 1; o < 32; o <<= 1) {
            const unsigned long long y = __shfl_up_sync(0xffffffffu, s, o);
            if (lane >= o) s += y;
        }
        scratch[lane] = s;
    }
    __syncthreads();
    const unsigned long long before = warp == 0 ? 0ull : scratch[warp - 1];
    *total = scratch[warps - 1];
    __syncthreads();
    return before + x - v;
}

// The id of the `nth` (0-based) element, in id order, for which `pick(i)` holds; every thread
// calls it with its chunk [begin, end). Returns the id to all threads (NO_TOKEN if there is
// none).
template <typename Pick>
__device__ uint32_t nth_in_id_order(Pick pick, int begin, int end, unsigned long long nth,
                                    unsigned long long *scratch, uint32_t *found) {
    unsigned long long mine = 0;
    for (int i = begin; i < end; ++i) mine += pick(i) ? 1ull : 0ull;
    unsigned long long total;
    if (threadIdx.x == 0) *found = NO_TOKEN;
    const unsigned long long before = block_scan(mine, scratch, &total);
    if (nth >= before && nth < before + mine) {
        unsigned long long at = before;
        for (int i = begin; i < end; ++i) {
            if (!pick(i)) continue;
            if (at == nth) {
                *found = (uint32_t)i;
                break;
            }
            ++at;
        }
    }
    __syncthreads();
    const uint32_t id = *found;
    __syncthreads();
    return id;
}

// One block per logit row; `out[row]` gets the token (NO_TOKEN when no logit is usable).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_rows(
    const float *__restrict__ logits, const SampleRow *__restrict__ rows,
    uint32_t *__restrict__ out, int vocab) {
    GRID_DEPENDENCY();
    __shared__ unsigned long long hist[256];
    __shared__ unsigned long long scratch[32];
    __shared__ float best_value[32];
    __shared__ uint32_t best_id[32];
    __shared__ uint32_t shared_u32[4];
    __shared__ unsigned long long shared_u64[2];
    const int row = blockIdx.x, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const float *l = logits + (size_t)row * vocab;
    const SampleRow p = rows[row];
    const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
    const int begin = min(tid * chunk, vocab), end = min(begin + chunk, vocab);

    // 1. Argmax (the first maximum) and the number of usable logits.
    float bv = -INFINITY;
    uint32_t bi = NO_TOKEN;
    unsigned long long usable = 0;
    for (int i = begin; i < end; ++i) {
        const float v = sanitize_logit(l[i]);
        if (v > bv) {
            bv = v;
            bi = (uint32_t)i;
        }
        if (v > -INFINITY) ++usable;
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_down_sync(0xffffffffu, bv, o);
        const uint32_t oi = __shfl_down_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) {
            bv = ov;
            bi = oi;
        }
    }
    if (lane == 0) {
        best_value[warp] = bv;
        best_id[warp] = bi;
    }
    unsigned long long candidates;
    block_scan(usable, scratch, &candidates);  // synchronizes the block
    if (tid == 0) {
        float v = best_value[0];
        uint32_t id = best_id[0];
        for (int w = 1; w < (int)(blockDim.x / 32); ++w) {
            if (best_value[w] > v || (best_value[w] == v && best_id[w] < id)) {
                v = best_value[w];
                id = best_id[w];
            }
        }
        best_value[0] = v;
        shared_u32[0] = id;
    }
    __syncthreads();
    const float max = best_value[0];
    const uint32_t best = shared_u32[0];
    if (max == -INFINITY) {
        if (tid == 0) out[row] = NO_TOKEN;
        return;
    }
    if (p.temperature == 0.0f || p.top_k == 1) {
        if (tid == 0) out[row] = best;
        return;
    }

    // 2. Top-k: the k-th largest key by radix select (8 bits a pass), then the lowest ids of
    // its ties.
    const bool top_k = p.top_k > 0 && (unsigned long long)p.top_k < candidates;
    uint32_t key_t = 0, cut_k = NO_TOKEN;
    if (top_k) {
        uint32_t prefix = 0, mask = 0;
        unsigned long long need = p.top_k;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int d = tid; d < 256; d += blockDim.x) hist[d] = 0;
            __syncthreads();
            for (int i = begin; i < end; ++i) {
                const float v = sanitize_logit(l[i]);
                if (v == -INFINITY) continue;
                const uint32_t key = order_key(v);
                if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1ull);
            }
            __syncthreads();
            if (tid == 0) {
                unsigned long long acc = 0;
                int sel = 0;
                for (int d = 255; d >= 0; --d) {
                    if (acc + hist[d] >= need) {
                        sel = d;
                        break;
                    }
                    acc += hist[d];
                }
                shared_u64[0] = need - acc;
                shared_u32[1] = prefix | ((uint32_t)sel << shift);
            }
            __syncthreads();
            need = shared_u64[0];
            prefix = shared_u32[1];
            mask |= 255u << shift;
            __syncthreads();
        }
        key_t = prefix;
        auto tie = [=](int i) {
            const float v = sanitize_logit(l[i]);
            return v > -INFINITY && order_key(v) == key_t;
        };
        cut_k = nth_in_id_order(tie, begin, end, need - 1, scratch, &shared_u32[2]);
    }
    auto kept_k = [=](int i, float v) {
        if (v == -INFINITY) return false;
        if (!top_k) return true;
        const uint32_t key = order_key(v);
        return key > key_t || (key == key_t && (uint32_t)i <= cut_k);
    };

    // 3. Weights, their total (before min-p), min-p.
    const float inv_t = p.inv_temperature;
    unsigned long long mine = 0;
    for (int i = begin; i < end; ++i) {
        const float v = sanitize_logit(l[i]);
        if (kept_k(i, v)) mine += fixed_weight(sample_weight(v, max, inv_t));
    }
    unsigned long long total;
    block_scan(mine, scratch, &total);
    const bool min_p = p.min_p > 0.0f;
    // Weight of token i when it survives top-k and min-p, else -1.
    auto kept_m = [=](int i) {
        const float v = sanitize_logit(l[i]);
        if (!kept_k(i, v)) return -1.0f;
        const float w = sample_weight(v, max, inv_t);
        return (min_p && !(w >= p.min_p)) ? -1.0f : w;
    };

    // 4. Top-p: the crossing weight by radix select over the weights' bits with their fixed-point
    // mass, then the lowest ids of its ties.
    bool top_p = p.top_p < 1.0f;
    uint32_t w_c = 0, cut_p = NO_TOKEN;
    if (top_p) {
        const unsigned long long target =
            (unsigned long long)__dmul_rn((double)p.top_p, __ull2double_rn(total));
        unsigned long long above = 0;
        uint32_t prefix = 0, mask = 0;
        for (int shift = 24; shift >= 0 && top_p; shift -= 8) {
            for (int d = tid; d < 256; d += blockDim.x) hist[d] = 0;
            __syncthreads();
            for (int i = begin; i < end; ++i) {
                const float w = kept_m(i);
                if (w < 0.0f) continue;
                const uint32_t b = __float_as_uint(w);
                if ((b & mask) == prefix) atomicAdd(&hist[(b >> shift) & 255u], fixed_weight(w));
            }
            __syncthreads();
            if (tid == 0) {
                int sel = -1;
                for (int d = 255; d >= 0; --d) {
                    if (hist[d] > 0 && above + hist[d] >= target) {
                        sel = d;
                        break;
                    }
                    above += hist[d];
                }
                shared_u32[3] = sel < 0 ? 0u : 1u;
                shared_u32[1] = prefix | ((uint32_t)(sel < 0 ? 0 : sel) << shift);
                shared_u64[1] = above;
            }
            __syncthreads();
            top_p = shared_u32[3] != 0;  // the kept mass never reaches the target: keep all
            prefix = shared_u32[1];
            above = shared_u64[1];
            mask |= 255u << shift;
            __syncthreads();
        }
        if (top_p) {
            w_c = prefix;
            const unsigned long long f = fixed_weight(__uint_as_float(w_c));
            // The crossing tie: the smallest j >= 1 with above + j * f >= target.
            const unsigned long long j = target > above ? (target - above + f - 1) / f : 1ull;
            auto tie = [=](int i) {
                const float w = kept_m(i);
                return w >= 0.0f && __float_as_uint(w) == w_c;
            };
            cut_p = nth_in_id_order(tie, begin, end, j - 1, scratch, &shared_u32[2]);
        }
    }
    auto kept = [=](int i) {
        const float w = kept_m(i);
        if (w < 0.0f) return -1.0f;
        if (!top_p) return w;
        const uint32_t b = __float_as_uint(w);
        return (b > w_c || (b == w_c && (uint32_t)i <= cut_p)) ? w : -1.0f;
    };

    // 5. The draw: the first id, in id order, whose cumulative weight passes uniform × mass;
    // the last kept id when rounding leaves the draw at the very end.
    mine = 0;
    uint32_t last = 0;
    bool any = false;
    for (int i = begin; i < end; ++i) {
        const float w = kept(i);
        if (w < 0.0f) continue;
        mine += fixed_weight(w);
        last = (uint32_t)i;
        any = true;
    }
    unsigned long long mass;
    const unsigned long long before = block_scan(mine, scratch, &mass);
    const unsigned long long r = (unsigned long long)__dmul_rn(p.uniform, __ull2double_rn(mass));
    if (tid == 0) shared_u32[2] = NO_TOKEN;
    __syncthreads();
    if (before <= r && r < before + mine) {
        unsigned long long acc = before;
        for (int i = begin; i < end; ++i) {
            const float w = kept(i);
            if (w < 0.0f) continue;
            acc += fixed_weight(w);
            if (acc > r) {
                shared_u32[2] = (uint32_t)i;
                break;
            }
        }
    }
    __syncthreads();
    // The thread holding the highest kept id answers when nobody crossed.
    if (shared_u32[2] == NO_TOKEN) {
        unsigned long long has = any ? 1ull : 0ull, kept_total;
        const unsigned long long after = block_scan(has, scratch, &kept_total);
        if (any && after + 1 == kept_total) out[row] = last;
    } else if (tid == 0) {
        out[row] = shared_u32[2];
    }
}
