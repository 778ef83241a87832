// Pure-read kernels for probe_bandwidth.py: how fast this card can stream bytes it only reads,
// the ceiling for decode steps, whose attention reads K/V once and whose GEMMs read weights once.

// NVRTC has no standard headers without CuPy's include path: plain types.
using u32 = unsigned int;
using u64 = unsigned long long;

// Every thread keeps UNROLL 16-byte loads in flight, grid-stride over the buffer (a persistent grid
// of a few CTAs per SM). The loads bypass L1 (.nc + no_allocate), as a streaming kernel's should.
template <int UNROLL>
__device__ __forceinline__ u32 read_range(const uint4* __restrict__ src, u64 begin, u64 end,
                                               u64 step) {
    u32 acc = 0;
    u64 i = begin;
    for (; i + (UNROLL - 1) * step < end; i += UNROLL * step) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const uint4* p = src + i + u * step;
            asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                         : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(p));
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < end; i += step) {
        uint4 v = src[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    return acc;
}

// The xor of everything read decides a store that never happens for the probe's zeroed buffers
// (acc == 0 there), so no load can be dropped and nothing is written.
template <int UNROLL>
__global__ void read_strided(const uint4* __restrict__ src, u64 n_vectors, u32* __restrict__ sink) {
    u64 step = (u64)gridDim.x * blockDim.x;
    u32 acc = read_range<UNROLL>(src, (u64)blockIdx.x * blockDim.x + threadIdx.x, n_vectors, step);
    if (acc == 0xdeadbeefu) sink[0] = acc;
}

// One CTA a contiguous chunk of `chunk_vectors`, as an attention kernel gives one CTA one row's K/V:
// the grid is as large as the work, so the last wave may be partly empty.
template <int UNROLL>
__global__ void read_chunked(const uint4* __restrict__ src, u64 n_vectors, u64 chunk_vectors,
                             u32* __restrict__ sink) {
    u64 begin = (u64)blockIdx.x * chunk_vectors;
    u64 end = begin + chunk_vectors < n_vectors ? begin + chunk_vectors : n_vectors;
    u32 acc = read_range<UNROLL>(src, begin + threadIdx.x, end, blockDim.x);
    if (acc == 0xdeadbeefu) sink[0] = acc;
}

// One CTA per (row, KV head) of a cache laid out [row, token, head, head_dim] for K, then V, as the
// engine's blocks hold it (NHD): each token gives the CTA `head_vectors` contiguous vectors (256
// bytes at head_dim 128, bf16), `heads` x that apart. The attention kernel's own access pattern,
// with the pages in order, so the difference from read_chunked is what the layout costs.
template <int UNROLL>
__global__ void read_heads(const uint4* __restrict__ src, u32 context, u32 heads, u32 head_vectors,
                           u64 v_offset, u32* __restrict__ sink) {
    u32 row = blockIdx.x / heads, head = blockIdx.x % heads;
    u64 base = ((u64)row * context * heads + head) * head_vectors;
    u64 token_stride = (u64)heads * head_vectors;
    u32 n = context * head_vectors;
    u32 acc = 0;
    u32 j = threadIdx.x;
    for (; j + (UNROLL - 1) * blockDim.x < n; j += UNROLL * blockDim.x) {
        uint4 k[UNROLL], v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            u32 idx = j + u * blockDim.x;
            const uint4* p = src + base + (idx / head_vectors) * token_stride + idx % head_vectors;
            asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                         : "=r"(k[u].x), "=r"(k[u].y), "=r"(k[u].z), "=r"(k[u].w) : "l"(p));
            asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                         : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(p + v_offset));
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) acc ^= k[u].x ^ k[u].y ^ k[u].z ^ k[u].w ^ v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; j < n; j += blockDim.x) {
        const uint4* p = src + base + (j / head_vectors) * token_stride + j % head_vectors;
        uint4 k = p[0], v = p[v_offset];
        acc ^= k.x ^ k.y ^ k.z ^ k.w ^ v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0xdeadbeefu) sink[0] = acc;
}
