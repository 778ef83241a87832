// Skinny GEMM: Y[M, N] = X[M, K] @ WT[K, N] for M <= 16 rows (decode steps of a few sequences),
// where WT is a projection's weight stored column-major (runner/gemm_layout.py): the transposed
// weight as a row-major [K, N] matrix, N contiguous. Such a product reads the whole weight for a
// handful of rows, so its speed is the weight's streaming rate; cuBLAS reaches ~3.5 TB/s of the
// H200's 4.8 there (benchmarks/probe_gemm.py). This kernel keeps many 16-byte weight loads in
// flight per thread and uses tensor cores (mma.sync m16n8k16, fp32 accumulation) only to do the
// multiply-adds cheaply. Not used by the engine yet: it measured 0.96x cuBLASLt (kernels/skinny_gemm.py).
//
// Work split: a CTA (8 warps) owns 64 output columns; its warps and `splits` CTAs along grid.y
// share K. Each warp step covers 16 k x 64 n: lane (g = lane / 4, t = lane % 4) loads rows
// k + 4t .. k + 4t + 3 of WT at columns n0 + 8g .. n0 + 8g + 7 (four 16-byte loads). MMA i (of 8)
// takes column n0 + 8g + i of those rows as its B fragment (column g of B): the pairs (rows 4t,
// 4t + 1) and (4t + 2, 4t + 3) stand for B's k = (2t, 2t + 1) and (2t + 8, 2t + 9), and X's A
// fragment is loaded with the same order of k, so every MMA sums over its 16 k in another order
// and the sum is the same. Its C column j then holds output column n0 + 8j + i.
// Partial sums meet in shared memory (the CTA's warps), then in a float workspace where
// splits > 1: the last CTA of a column tile to finish (an atomic counter it resets) adds them and
// writes Y. So one launch per product, capturable in a CUDA graph.

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

// 16-bit storage types (no cuda_bf16.h / cuda_fp16.h: NVRTC through CuPy need not find them).
struct bf16_t { u16 bits; };
struct fp16_t { u16 bits; };

#define SKINNY_WARPS 8
#define SKINNY_TILE_N 64
#define SKINNY_MAX_ROWS 16
#define SKINNY_RED_STRIDE 65  // a row of the reduction buffer, padded against bank conflicts

template <bool BF16>
__device__ __forceinline__ void mma_16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    if constexpr (BF16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
}

__device__ __forceinline__ uint4 load_weights(const void* p) {
    return __ldg(reinterpret_cast<const uint4*>(p));
}

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ bf16_t from_float<bf16_t>(float v) {
    bf16_t r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(v));
    return r;
}
template <>
__device__ __forceinline__ fp16_t from_float<fp16_t>(float v) {
    fp16_t r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(v));
    return r;
}

// Four rows of WT (k + 4t + j, j = 0..3) at this lane's 8 columns: 8 MMAs over 16 k.
template <bool BF16>
__device__ __forceinline__ void mma_step(float (*acc)[4], const uint4* w, uint2 lo, uint2 hi) {
    const u32 r0[4] = {w[0].x, w[0].y, w[0].z, w[0].w};
    const u32 r1[4] = {w[1].x, w[1].y, w[1].z, w[1].w};
    const u32 r2[4] = {w[2].x, w[2].y, w[2].z, w[2].w};
    const u32 r3[4] = {w[3].x, w[3].y, w[3].z, w[3].w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const u32 sel = (i & 1) ? 0x7632u : 0x5410u;  // column i's 16 bits of two rows, paired
        const u32 b0 = __byte_perm(r0[i >> 1], r1[i >> 1], sel);
        const u32 b1 = __byte_perm(r2[i >> 1], r3[i >> 1], sel);
        mma_16816<BF16>(acc[i], lo.x, hi.x, lo.y, hi.y, b0, b1);
    }
}

template <typename T, bool BF16, bool UPPER, int UNROLL>
__device__ __forceinline__ void skinny_gemm(const T* __restrict__ x, i64 ldx, const T* __restrict__ wt, i64 ldw,
                                            T* __restrict__ y, i64 ldy, float* __restrict__ ws,
                                            int* __restrict__ counters, int rows, int n, int k, int splits) {
    __shared__ float red[SKINNY_WARPS][SKINNY_MAX_ROWS][SKINNY_RED_STRIDE];
    __shared__ int last_cta;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int tile = blockIdx.x, split = blockIdx.y;
    const int n0 = tile * SKINNY_TILE_N;
    const int steps = k / 16, parts = splits * SKINNY_WARPS, part = split * SKINNY_WARPS + warp;
    const int first = (int)((i64)steps * part / parts), end = (int)((i64)steps * (part + 1) / parts);

    float acc[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

    const char* wbase = reinterpret_cast<const char*>(wt + (i64)(4 * t) * ldw + n0 + 8 * g);
    const i64 wrow = ldw * (i64)sizeof(T);
    const bool has_lo = g < rows, has_hi = UPPER && g + 8 < rows;
    const T* xlo = x + (i64)g * ldx + 4 * t;
    const T* xhi = x + (i64)(g + 8) * ldx + 4 * t;

    int s = first;
    for (; s + UNROLL <= end; s += UNROLL) {
        uint4 w[UNROLL][4];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
#pragma unroll
            for (int j = 0; j < 4; ++j) w[u][j] = load_weights(wbase + ((i64)(s + u) * 16 + j) * wrow);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const i64 kk = (i64)(s + u) * 16;
            const uint2 lo = has_lo ? *reinterpret_cast<const uint2*>(xlo + kk) : make_uint2(0u, 0u);
            const uint2 hi = has_hi ? *reinterpret_cast<const uint2*>(xhi + kk) : make_uint2(0u, 0u);
            mma_step<BF16>(acc, w[u], lo, hi);
        }
    }
    for (; s < end; ++s) {
        uint4 w[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) w[j] = load_weights(wbase + ((i64)s * 16 + j) * wrow);
        const i64 kk = (i64)s * 16;
        const uint2 lo = has_lo ? *reinterpret_cast<const uint2*>(xlo + kk) : make_uint2(0u, 0u);
        const uint2 hi = has_hi ? *reinterpret_cast<const uint2*>(xhi + kk) : make_uint2(0u, 0u);
        mma_step<BF16>(acc, w, lo, hi);
    }

    // acc[i][0..1]: row g, columns 16t + i and 16t + 8 + i of the tile; [2..3]: row g + 8, the same.
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        red[warp][g][16 * t + i] = acc[i][0];
        red[warp][g][16 * t + 8 + i] = acc[i][1];
        if (UPPER) {
            red[warp][g + 8][16 * t + i] = acc[i][2];
            red[warp][g + 8][16 * t + 8 + i] = acc[i][3];
        }
    }
    __syncthreads();
    const int outputs = rows * SKINNY_TILE_N;
    for (int o = threadIdx.x; o < outputs; o += blockDim.x) {
        const int m = o / SKINNY_TILE_N, c = o % SKINNY_TILE_N;
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < SKINNY_WARPS; ++w) v += red[w][m][c];
        if (splits == 1) {
            y[(i64)m * ldy + n0 + c] = from_float<T>(v);
        } else {
            ws[((i64)split * SKINNY_MAX_ROWS + m) * n + n0 + c] = v;
        }
    }
    if (splits == 1) return;
    __threadfence();  // this CTA's partial sums are visible before it counts itself in
    __syncthreads();
    if (threadIdx.x == 0) last_cta = atomicAdd(&counters[tile], 1) == splits - 1;
    __syncthreads();
    if (!last_cta) return;
    __threadfence();
    for (int o = threadIdx.x; o < outputs; o += blockDim.x) {
        const int m = o / SKINNY_TILE_N, c = o % SKINNY_TILE_N;
        float v = 0.f;
        for (int p = 0; p < splits; ++p) v += __ldcg(ws + ((i64)p * SKINNY_MAX_ROWS + m) * n + n0 + c);
        y[(i64)m * ldy + n0 + c] = from_float<T>(v);
    }
    if (threadIdx.x == 0) counters[tile] = 0;  // ready for the next launch (or graph replay)
}

#define SKINNY_KERNEL(NAME, T, BF16, UPPER, UNROLL)                                                          \
    extern "C" __global__ void __launch_bounds__(SKINNY_WARPS * 32, 2)                                    \
        skinny_gemm_##NAME(const T* x, i64 ldx, const T* wt, i64 ldw, T* y, i64 ldy, float* ws, int* counters, \
                           int rows, int n, int k, int splits) {                                           \
        skinny_gemm<T, BF16, UPPER, UNROLL>(x, ldx, wt, ldw, y, ldy, ws, counters, rows, n, k, splits);    \
    }

// rows <= 8 (r8) or <= 16 (r16); u2 / u4: weight steps loaded ahead per warp.
SKINNY_KERNEL(bf16_r8_u2, bf16_t, true, false, 2)
SKINNY_KERNEL(bf16_r16_u2, bf16_t, true, true, 2)
SKINNY_KERNEL(bf16_r8_u4, bf16_t, true, false, 4)
SKINNY_KERNEL(bf16_r16_u4, bf16_t, true, true, 4)
SKINNY_KERNEL(fp16_r8_u2, fp16_t, false, false, 2)
SKINNY_KERNEL(fp16_r16_u2, fp16_t, false, true, 2)
SKINNY_KERNEL(fp16_r8_u4, fp16_t, false, false, 4)
SKINNY_KERNEL(fp16_r16_u4, fp16_t, false, true, 4)
