// Paged KV-cache data movement: write new tokens into their slots, copy whole blocks.
//
// The pool is a list of chunks (each a separate allocation, so the pool can grow and give its
// tail back). A chunk holds `chunk_blocks` blocks for every layer, laid out as
//   [num_layers][2 (K, V)][chunk_blocks][block_size][num_kv_heads][head_dim]
// and `chunk_ptrs[c]` is the base address of chunk c. Block b lives in chunk b / chunk_blocks.
//
// Both kernels only move bytes, so one instantiation per vector width (16, 8, 4, 2 bytes)
// serves every dtype and the copies are bit-exact. The Python wrapper picks the widest width
// that divides every size, stride and base address. An FP8 pool's writes quantize instead
// (write_slots_fp8_*, fp8.cuh); its block copies move bytes like any other. Compiled by NVRTC
// through CuPy: no standard headers.

#include "fp8.cuh"

typedef long long i64;

// Bytes of one (layer, K-or-V) slice of one block.
__device__ __forceinline__ char* block_base(const unsigned long long* __restrict__ chunk_ptrs,
                                            i64 block, int layer_kv, int chunk_blocks,
                                            i64 layer_block_bytes) {
    const i64 chunk = block / chunk_blocks;
    const i64 within = block - chunk * chunk_blocks;
    return reinterpret_cast<char*>(chunk_ptrs[chunk]) +
           ((i64)layer_kv * chunk_blocks + within) * layer_block_bytes;
}

// Where a token in `slot` of `layer` keeps its K row (every head, row_bytes each as stored) and its V
// row; false for a padding slot (< 0), which is skipped.
__device__ __forceinline__ bool slot_rows(const unsigned long long* __restrict__ chunk_ptrs, i64 slot,
                                          int layer, int num_heads, int row_bytes, int block_size,
                                          int chunk_blocks, char** k_dst, char** v_dst) {
    if (slot < 0) return false;
    const i64 block = slot / block_size;
    const i64 layer_block_bytes = (i64)block_size * num_heads * row_bytes;
    const i64 in_block = (slot - block * block_size) * num_heads * row_bytes;
    *k_dst = block_base(chunk_ptrs, block, 2 * layer, chunk_blocks, layer_block_bytes) + in_block;
    *v_dst = block_base(chunk_ptrs, block, 2 * layer + 1, chunk_blocks, layer_block_bytes) + in_block;
    return true;
}

// grid = (num_tokens, num_layers_in), one CTA per (token, layer); each CTA writes that token's
// K and V rows for all heads. Slots < 0 are padding and skipped.
// Strides are in bytes; head_dim is contiguous in the source.
template <typename V>
__device__ void write_slots(const char* __restrict__ keys, const char* __restrict__ values,
                            const i64* __restrict__ slot_mapping,
                            const unsigned long long* __restrict__ chunk_ptrs,
                            i64 k_layer_stride, i64 k_token_stride, i64 k_head_stride,
                            i64 v_layer_stride, i64 v_token_stride, i64 v_head_stride,
                            int num_heads, int row_bytes, int block_size, int chunk_blocks,
                            int layer_start) {
    const int token = blockIdx.x;
    const int layer_in = blockIdx.y;
    char *k_dst, *v_dst;
    if (!slot_rows(chunk_ptrs, slot_mapping[token], layer_start + layer_in, num_heads, row_bytes, block_size,
                   chunk_blocks, &k_dst, &v_dst))
        return;
    const char* k_src = keys + layer_in * k_layer_stride + token * k_token_stride;
    const char* v_src = values + layer_in * v_layer_stride + token * v_token_stride;

    const int row_vecs = row_bytes / (int)sizeof(V);
    const int total = num_heads * row_vecs;
    for (int i = threadIdx.x; i < total; i += blockDim.x) {
        const int head = i / row_vecs;
        const int vec = i - head * row_vecs;
        // Both loads before either store: two independent loads in flight per thread.
        const V k = *reinterpret_cast<const V*>(k_src + head * k_head_stride + vec * sizeof(V));
        const V v = *reinterpret_cast<const V*>(v_src + head * v_head_stride + vec * sizeof(V));
        reinterpret_cast<V*>(k_dst)[i] = k;
        reinterpret_cast<V*>(v_dst)[i] = v;
    }
}

// An FP8 pool's write_slots: the same grid, each thread quantizing four elements of a row with
// the layer's K or V scale (kv_scales [num_layers][2]) and storing them as one 4-byte word.
// Strides are in elements of the 16-bit source; head_dim is contiguous and a multiple of 4.
template <bool IS_FP16>
__device__ void write_slots_fp8(const unsigned short* __restrict__ keys, const unsigned short* __restrict__ values,
                                const i64* __restrict__ slot_mapping,
                                const unsigned long long* __restrict__ chunk_ptrs,
                                const float* __restrict__ kv_scales,
                                i64 k_layer_stride, i64 k_token_stride, i64 k_head_stride,
                                i64 v_layer_stride, i64 v_token_stride, i64 v_head_stride,
                                int num_heads, int head_dim, int block_size, int chunk_blocks,
                                int layer_start) {
    const int token = blockIdx.x;
    const int layer_in = blockIdx.y;
    const int layer = layer_start + layer_in;
    char *k_row, *v_row;  // one byte an element
    if (!slot_rows(chunk_ptrs, slot_mapping[token], layer, num_heads, head_dim, block_size, chunk_blocks,
                   &k_row, &v_row))
        return;
    unsigned int* k_dst = reinterpret_cast<unsigned int*>(k_row);
    unsigned int* v_dst = reinterpret_cast<unsigned int*>(v_row);
    const unsigned short* k_src = keys + layer_in * k_layer_stride + token * k_token_stride;
    const unsigned short* v_src = values + layer_in * v_layer_stride + token * v_token_stride;
    const float k_scale = kv_scales[2 * layer], v_scale = kv_scales[2 * layer + 1];
    const int row_words = head_dim / 4;
    const int total = num_heads * row_words;
    for (int i = threadIdx.x; i < total; i += blockDim.x) {
        const int head = i / row_words;
        const int e = (i - head * row_words) * 4;
        const unsigned short* kp = k_src + head * k_head_stride + e;
        const unsigned short* vp = v_src + head * v_head_stride + e;
        unsigned int kw = 0, vw = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            kw |= (unsigned int)fp8_e4m3_quantize(bits16_to_float<IS_FP16>(kp[j]), k_scale) << (8 * j);
            vw |= (unsigned int)fp8_e4m3_quantize(bits16_to_float<IS_FP16>(vp[j]), v_scale) << (8 * j);
        }
        k_dst[i] = kw;
        v_dst[i] = vw;
    }
}

#define PONYTAIL_WRITE_FP8(SUFFIX, IS_FP16)                                                    \
    extern "C" __global__ void write_slots_fp8_##SUFFIX(                                       \
        const unsigned short* keys, const unsigned short* values, const i64* slot_mapping,     \
        const unsigned long long* chunk_ptrs, const float* kv_scales, i64 k_layer_stride,      \
        i64 k_token_stride, i64 k_head_stride, i64 v_layer_stride, i64 v_token_stride,         \
        i64 v_head_stride, int num_heads, int head_dim, int block_size, int chunk_blocks,      \
        int layer_start) {                                                                     \
        write_slots_fp8<IS_FP16>(keys, values, slot_mapping, chunk_ptrs, kv_scales,            \
                                 k_layer_stride, k_token_stride, k_head_stride, v_layer_stride, \
                                 v_token_stride, v_head_stride, num_heads, head_dim,           \
                                 block_size, chunk_blocks, layer_start);                       \
    }

PONYTAIL_WRITE_FP8(bf16, false)
PONYTAIL_WRITE_FP8(fp16, true)

// grid = (num_pairs, 2 * num_layers): one CTA copies one (layer, K-or-V) slice of one block.
// `pairs` is [num_pairs][2] of (src, dst) block ids; no dst may also be a src (checked on the host).
template <typename V, int UNROLL>
__device__ void copy_blocks(const unsigned long long* __restrict__ chunk_ptrs,
                            const i64* __restrict__ pairs, int chunk_blocks,
                            i64 layer_block_bytes) {
    const i64 src_block = pairs[2 * blockIdx.x];
    const i64 dst_block = pairs[2 * blockIdx.x + 1];
    const int layer_kv = blockIdx.y;
    const V* src = reinterpret_cast<const V*>(
        block_base(chunk_ptrs, src_block, layer_kv, chunk_blocks, layer_block_bytes));
    V* dst = reinterpret_cast<V*>(
        block_base(chunk_ptrs, dst_block, layer_kv, chunk_blocks, layer_block_bytes));
    const i64 n = layer_block_bytes / (i64)sizeof(V);
    const i64 step = (i64)blockDim.x * UNROLL;
    for (i64 base = threadIdx.x; base < n; base += step) {
        V tmp[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const i64 j = base + (i64)u * blockDim.x;
            if (j < n) tmp[u] = src[j];
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const i64 j = base + (i64)u * blockDim.x;
            if (j < n) dst[j] = tmp[u];
        }
    }
}

#define PONYTAIL_CACHE_OPS(SUFFIX, V)                                                          \
    extern "C" __global__ void write_slots_##SUFFIX(                                           \
        const char* keys, const char* values, const i64* slot_mapping,                         \
        const unsigned long long* chunk_ptrs, i64 k_layer_stride, i64 k_token_stride,          \
        i64 k_head_stride, i64 v_layer_stride, i64 v_token_stride, i64 v_head_stride,          \
        int num_heads, int row_bytes, int block_size, int chunk_blocks, int layer_start) {     \
        write_slots<V>(keys, values, slot_mapping, chunk_ptrs, k_layer_stride, k_token_stride, \
                       k_head_stride, v_layer_stride, v_token_stride, v_head_stride,           \
                       num_heads, row_bytes, block_size, chunk_blocks, layer_start);           \
    }                                                                                          \
    extern "C" __global__ void copy_blocks_##SUFFIX##_u4(const unsigned long long* chunk_ptrs, \
                                                         const i64* pairs, int chunk_blocks,   \
                                                         i64 layer_block_bytes) {              \
        copy_blocks<V, 4>(chunk_ptrs, pairs, chunk_blocks, layer_block_bytes);                 \
    }

PONYTAIL_CACHE_OPS(v16, uint4)
PONYTAIL_CACHE_OPS(v8, uint2)
PONYTAIL_CACHE_OPS(v4, unsigned int)
PONYTAIL_CACHE_OPS(v2, unsigned short)
