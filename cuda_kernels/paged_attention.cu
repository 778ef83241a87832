// Paged attention: the decode kernel (one new token per sequence), its split-KV reduction, and a
// gather of a layer's paged K/V into contiguous [batch, kv_heads, tokens, head_dim] buffers for
// the prefill path (which then runs torch's SDPA).
//
// Pool layout (see cache_ops.cu): chunk c holds [num_layers][2 (K, V)][chunk_blocks][block_size]
// [num_kv_heads][head_dim] and chunk_ptrs[c] is its base address; block b lives in chunk
// b / chunk_blocks. One token's row for one KV head is head_dim contiguous elements; consecutive
// tokens of one head are num_kv_heads * head_dim elements apart.
//
// Sliding windows (Mistral, Gemma 3's local layers): the `_w` decode kernels take `window` and
// attend a row's last `window` tokens only. Splits then start at the block holding the window's
// first token, so the work goes with the window, not the row; tokens before it in that block are
// masked. The kernels without `_w` are the same code with WINDOWED false, compiled as before.
//
// Decode: grid (splits, kv_heads * groups, batch), one CTA per (split, KV head, group of up to
// GROUP query heads sharing that KV head), so every K/V byte is read once per group. Each warp
// streams its own steps of TOK tokens: a row of head_dim elements is read by LPR lanes with
// 16-byte copies (a 256-byte bf16 row = 16 lanes) into a per-warp shared-memory ring (cp.async),
// several steps ahead of the step being computed, so K and V bytes stay in flight without
// holding registers. Scores are reduced across the LPR lanes of a row with xor shuffles; the
// softmax is online, in fp32, in base 2 on a query pre-scaled by scale * log2(e). Block addresses
// are resolved once per block into a shared-memory table, not per token. Warps merge through
// shared memory at the end; with one split the CTA writes the output, otherwise it writes its
// unnormalized (acc, max, sum) to an fp32 workspace and paged_decode_reduce combines the splits.
//
// The step's own K/V (new_k non-null): the CTAs of the split that holds a row's last token first
// copy that token's K and V for their KV head from new_k / new_v into slots[b], then stream it
// back with the rest. One launch fewer per layer and step than writing the cache beforehand; CTAs
// of several query-head groups of one KV head write the same bytes, which is harmless.
//
// FP8 pools (compiled as a module of their own, with PONYTAIL_FP8 defined, only where a pool is
// FP8): the kernels are templated on the model's dtype T and the stored dtype KV separately. K/V
// bytes move exactly as before (16 elements per 16-byte copy instead of 8: half the bytes per
// token) and are widened in registers (fp8.cuh); the layer's K scale is folded into the query's
// pre-scale and its V scale into the output, so no scale is applied per element. The new token
// is quantized as cache_ops.cu's write_slots_fp8 does. The prefill gathers dequantize into T.
//
// Compiled by NVRTC through CuPy: no standard headers, so fp16/bf16 conversions are inline PTX.

#include "fp8.cuh"

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

struct bf16_t { u16 bits; };
struct fp16_t { u16 bits; };
struct fp8_t { unsigned char bits; };  // E4M3, as stored in an FP8 pool

// ----------------------------------------------------------------------------------- dtypes
template <typename T> struct Dtype;

template <> struct Dtype<float> {
    static constexpr int kPerVec = 4;  // elements per 16-byte vector
    __device__ __forceinline__ static void unpack(const uint4& v, float* f) {
        f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
        f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
    }
    __device__ __forceinline__ static float to_float(float x) { return x; }
    __device__ __forceinline__ static float from_float(float x) { return x; }
};

template <> struct Dtype<bf16_t> {
    static constexpr int kPerVec = 8;
    __device__ __forceinline__ static void unpack2(u32 w, float* f) {
        f[0] = __uint_as_float(w << 16);
        f[1] = __uint_as_float(w & 0xffff0000u);
    }
    __device__ __forceinline__ static void unpack(const uint4& v, float* f) {
        unpack2(v.x, f); unpack2(v.y, f + 2); unpack2(v.z, f + 4); unpack2(v.w, f + 6);
    }
    __device__ __forceinline__ static float to_float(bf16_t x) { return __uint_as_float((u32)x.bits << 16); }
    __device__ __forceinline__ static bf16_t from_float(float x) {
        bf16_t r;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
        return r;
    }
};

template <> struct Dtype<fp16_t> {
    static constexpr int kPerVec = 8;
    __device__ __forceinline__ static void unpack2(u32 w, float* f) {
        asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\t"
            "cvt.f32.f16 %0, lo;\n\tcvt.f32.f16 %1, hi;\n\t}"
            : "=f"(f[0]), "=f"(f[1]) : "r"(w));
    }
    __device__ __forceinline__ static void unpack(const uint4& v, float* f) {
        unpack2(v.x, f); unpack2(v.y, f + 2); unpack2(v.z, f + 4); unpack2(v.w, f + 6);
    }
    __device__ __forceinline__ static float to_float(fp16_t x) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
        return f;
    }
    __device__ __forceinline__ static fp16_t from_float(float x) {
        fp16_t r;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
        return r;
    }
};

// Stored FP8: unpack widens to value / PONYTAIL_FP8_WIDEN_FACTOR (the kernels fold the factor in).
template <> struct Dtype<fp8_t> {
    static constexpr int kPerVec = 16;
    __device__ __forceinline__ static void unpack(const uint4& v, float* f) {
        fp8x4_widen(v.x, f); fp8x4_widen(v.y, f + 4); fp8x4_widen(v.z, f + 8); fp8x4_widen(v.w, f + 12);
    }
};

// A model element as the cache stores it: as is, or quantized with the layer's scale.
template <typename T, typename KV>
__device__ __forceinline__ KV to_cache(T x, float scale) {
    if constexpr (sizeof(KV) == 1) {
        KV r;
        r.bits = fp8_e4m3_quantize(Dtype<T>::to_float(x), scale);
        return r;
    } else {
        return x;
    }
}

// ---------------------------------------------------------------------------------- helpers
__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx(-inf) = 0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

constexpr int pow2_ceil(int n) { return n <= 1 ? 1 : 2 * pow2_ceil((n + 1) / 2); }

// Tokens of a sequence that attend: seq_len, clamped to the table, or 0 for a padding row.
__device__ __forceinline__ int attended_tokens(const int* seq_lens, const int* query_lens, int b,
                                               int max_tokens) {
    int n = seq_lens[b];
    if (query_lens != nullptr && query_lens[b] <= 0) n = 0;
    return n < 0 ? 0 : (n > max_tokens ? max_tokens : n);
}

// ------------------------------------------------------------------------------ decode kernel
// LOADS 16-byte K vectors (and as many V vectors) per lane per step; STAGES steps per warp in a
// shared-memory ring, STAGES - 1 of them in flight while one is computed; ROWVECS 16-byte vectors
// of a row per lane (2 halves the lanes per row, and so the shuffles per score, for twice the
// query and accumulator registers). All three are part of the kernel name (..._l4s3v1), so the
// launch picks the configuration this file instantiates from attention/decode.py's LAUNCH.
template <typename KV, int HEAD_DIM, int GROUP, int LOADS, int ROWVECS>
struct DecodeShape {
    static constexpr int EPV = Dtype<KV>::kPerVec;                // elements per 16-byte vector
    static constexpr int NV = HEAD_DIM / EPV;                     // vectors per row
    static constexpr int LPR_WANTED = pow2_ceil((NV + ROWVECS - 1) / ROWVECS);
    static constexpr int LPR = LPR_WANTED > 32 ? 32 : LPR_WANTED; // lanes per row
    static constexpr int VPL = (NV + LPR - 1) / LPR;              // vectors per lane per row
    static constexpr int RPW = 32 / LPR;                          // rows per warp-wide load
    static constexpr int ROUNDS = LOADS / VPL > 0 ? LOADS / VPL : 1;  // rows per lane per step
    static constexpr int TOK = ROUNDS * RPW;                      // tokens per warp step
    static constexpr int SLOTS = ROUNDS * VPL;                    // 16-byte ring slots per lane, K or V
    static_assert(HEAD_DIM % EPV == 0, "head_dim must be a whole number of 16-byte vectors");
    static_assert(SLOTS == LOADS, "the host sizes the ring as LOADS slots per lane");
};

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{\n\t.reg .u64 t;\n\tcvta.to.shared.u64 t, %1;\n\tcvt.u32.u64 %0, t;\n\t}" : "=r"(r) : "l"(p));
    return r;
}

// 16 bytes global -> shared (a shared-window address), bypassing L1 and registers; zero-filled
// when !valid (nothing is read).
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}

// grid (splits, kv_heads * groups, batch). Dynamic shared memory: the split's block addresses
// (split_blocks u64), then per warp a ring [STAGES][K, V][SLOTS][32 lanes] of 16-byte vectors;
// each lane reads back only the vectors it copied itself, so the ring needs no warp barrier.
// kv_scales (FP8 pools only, else null): [num_layers][2] fp32, the layers' K and V scales.
template <typename T, typename KV, int HEAD_DIM, int GROUP, int LOADS, int STAGES, int ROWVECS, bool WINDOWED>
__device__ void paged_decode(
    const T* __restrict__ query, i64 q_batch_stride, i64 q_head_stride,
    T* __restrict__ out, float* __restrict__ ws_acc, float* __restrict__ ws_ml,
    const u64* __restrict__ chunk_ptrs, const int* __restrict__ block_tables, int table_stride,
    const int* __restrict__ seq_lens, const int* __restrict__ query_lens,
    int num_kv_heads, int group_size, int block_size_log2, int chunk_blocks, int num_blocks,
    int layer, int max_tokens, int split_tokens, float scale_log2, const T* __restrict__ new_k,
    const T* __restrict__ new_v, i64 k_token_stride, i64 k_head_stride, i64 v_token_stride,
    i64 v_head_stride, const i64* __restrict__ slots, const float* __restrict__ kv_scales, int window) {
    using S = DecodeShape<KV, HEAD_DIM, GROUP, LOADS, ROWVECS>;
    constexpr bool FP8 = sizeof(KV) == 1;
    constexpr int EPV = S::EPV, NV = S::NV, LPR = S::LPR, VPL = S::VPL, RPW = S::RPW;
    constexpr int ROUNDS = S::ROUNDS, TOK = S::TOK, SLOTS = S::SLOTS;

    extern __shared__ __align__(16) unsigned char smem[];

    const int split = blockIdx.x;
    const int num_splits = gridDim.x;
    const int groups = gridDim.y / num_kv_heads;
    const int kv_head = blockIdx.y / groups;
    const int group = blockIdx.y - kv_head * groups;
    const int b = blockIdx.z;
    const int num_heads = num_kv_heads * group_size;
    const int head0 = kv_head * group_size + group * GROUP;  // first query head of this CTA
    const int heads_here = min(GROUP, group_size - group * GROUP);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int num_warps = blockDim.x >> 5;
    const int row = lane / LPR, col = lane % LPR;

    const int n = attended_tokens(seq_lens, query_lens, b, max_tokens);
    // With a window: the first token attended (lo) and the block-aligned start of the splits.
    int lo = 0, base = 0;
    if constexpr (WINDOWED) {
        lo = max(0, n - window);
        base = (lo >> block_size_log2) << block_size_log2;
    }
    const int t_begin = base + split * split_tokens;  // block-aligned
    const int t_end = min(t_begin + split_tokens, n);
    if (t_begin >= t_end) {
        // Nothing to attend. With splits the reduction knows which splits ran; alone, write zeros.
        if (num_splits == 1) {
            for (int i = threadIdx.x; i < heads_here * HEAD_DIM; i += blockDim.x)
                out[((i64)b * num_heads + head0 + i / HEAD_DIM) * HEAD_DIM + i % HEAD_DIM] =
                    Dtype<T>::from_float(0.f);
        }
        return;
    }

    // The split's block addresses (K of this layer and KV head), resolved once per block.
    const int split_blocks_max = split_tokens >> block_size_log2;
    u64* table = reinterpret_cast<u64*>(smem);
    uint4* ring = reinterpret_cast<uint4*>(smem + ((split_blocks_max * 8 + 15) & ~15)) +
                  warp * (STAGES * 2 * SLOTS * 32) + lane;
    const int block_size = 1 << block_size_log2;
    const i64 token_stride = (i64)num_kv_heads * HEAD_DIM;          // elements
    const i64 block_elems = token_stride << block_size_log2;        // one block of one layer, K or V
    const i64 v_offset = (i64)chunk_blocks * block_elems;           // V block = K block + this
    const int first_block = t_begin >> block_size_log2;
    const int split_blocks = (t_end - t_begin + block_size - 1) >> block_size_log2;
    const int* table_row = block_tables + (i64)b * table_stride + first_block;
    for (int i = threadIdx.x; i < split_blocks; i += blockDim.x) {
        int id = table_row[i];
        if (id < 0 || id >= num_blocks) id = 0;  // never read outside the pool
        const int chunk = id / chunk_blocks;
        const int within = id - chunk * chunk_blocks;
        const KV* base = reinterpret_cast<const KV*>(chunk_ptrs[chunk]) +
                        ((i64)(2 * layer) * chunk_blocks + within) * block_elems +
                        (i64)kv_head * HEAD_DIM;
        table[i] = reinterpret_cast<u64>(base);
    }
    if (new_k != nullptr && t_end == n) {  // this row's new token lies in this split: write it first
        const i64 slot = slots[b];
        const i64 id = slot >> block_size_log2;
        if (slot >= 0 && id < num_blocks) {
            const i64 chunk = id / chunk_blocks;
            KV* k_dst = reinterpret_cast<KV*>(chunk_ptrs[chunk]) +
                       ((i64)(2 * layer) * chunk_blocks + (id - chunk * chunk_blocks)) * block_elems +
                       (slot & (block_size - 1)) * token_stride + (i64)kv_head * HEAD_DIM;
            const T* k_src = new_k + b * k_token_stride + kv_head * k_head_stride;
            const T* v_src = new_v + b * v_token_stride + kv_head * v_head_stride;
            const float k_scale = FP8 ? kv_scales[2 * layer] : 1.f;
            const float v_scale = FP8 ? kv_scales[2 * layer + 1] : 1.f;
            for (int i = threadIdx.x; i < HEAD_DIM; i += blockDim.x) {
                const T k = k_src[i], v = v_src[i];
                k_dst[i] = to_cache<T, KV>(k, k_scale);
                k_dst[v_offset + i] = to_cache<T, KV>(v, v_scale);
            }
        }
    }

    // This lane's query elements, fp32, pre-scaled into the log2 domain (and, FP8, by the K scale
    // times the widening factor: the scores then come out right from the widened bytes). The V
    // scale multiplies the output instead. Missing heads are 0.
    const float q_scale = FP8 ? scale_log2 * kv_scales[2 * layer] * PONYTAIL_FP8_WIDEN_FACTOR : scale_log2;
    const float v_mult = FP8 ? kv_scales[2 * layer + 1] * PONYTAIL_FP8_WIDEN_FACTOR : 1.f;
    float q[GROUP][VPL][EPV];
#pragma unroll
    for (int g = 0; g < GROUP; ++g)
#pragma unroll
        for (int k = 0; k < VPL; ++k) {
            const int vec = col + k * LPR;
#pragma unroll
            for (int e = 0; e < EPV; ++e) q[g][k][e] = 0.f;
            if (g < heads_here && (NV % LPR == 0 || vec < NV)) {
                const T* qp = query + b * q_batch_stride + (i64)(head0 + g) * q_head_stride + vec * EPV;
#pragma unroll
                for (int e = 0; e < EPV; ++e) q[g][k][e] = Dtype<T>::to_float(qp[e]) * q_scale;
            }
        }

    float m[GROUP], l[GROUP], acc[GROUP][VPL][EPV];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        m[g] = neg_inf();
        l[g] = 0.f;
#pragma unroll
        for (int k = 0; k < VPL; ++k)
#pragma unroll
            for (int e = 0; e < EPV; ++e) acc[g][k][e] = 0.f;
    }
    __syncthreads();  // the table is complete, the new token written

    // Copy step `s0` (tokens s0 .. s0 + TOK - 1 of this warp) into ring stage `stage`. Byte
    // addresses; a lane's slot (round r, vector k) is 16 bytes at ((r * VPL + k) * 32 + lane) * 16.
    const u32 ring_addr = smem_addr(ring);
    const i64 token_bytes = token_stride * (i64)sizeof(KV);
    const i64 v_offset_bytes = v_offset * (i64)sizeof(KV);
    auto issue = [&](int stage, int s0) {
        if (s0 < t_end) {
            const u32 dst = ring_addr + stage * (2 * SLOTS * 32 * 16);
            const int first_slot = (s0 - t_begin) >> block_size_log2;
            if (s0 + TOK <= t_end && ((s0 + TOK - 1 - t_begin) >> block_size_log2) == first_slot) {
                // The whole step lies in one block (warp-uniform): one table read per step.
                const char* base = reinterpret_cast<const char*>(table[first_slot]) +
                                   (i64)((s0 + row) & (block_size - 1)) * token_bytes;
#pragma unroll
                for (int r = 0; r < ROUNDS; ++r)
#pragma unroll
                    for (int k = 0; k < VPL; ++k) {
                        const bool in_row = NV % LPR == 0 || col + k * LPR < NV;
                        // An idle lane (past the row's end) reads nothing; its address stays the row's.
                        const char* src = base + r * RPW * token_bytes + (in_row ? (col + k * LPR) * 16 : 0);
                        const u32 slot = dst + (r * VPL + k) * 32 * 16;
                        cp_async16(slot, src, in_row);
                        cp_async16(slot + SLOTS * 32 * 16, src + v_offset_bytes, in_row);
                    }
            } else {
#pragma unroll
                for (int r = 0; r < ROUNDS; ++r) {
                    const int t = s0 + r * RPW + row;
                    const int slot_index = min((t - t_begin) >> block_size_log2, split_blocks - 1);
                    const char* kp = reinterpret_cast<const char*>(table[slot_index]) +
                                     (i64)(t & (block_size - 1)) * token_bytes;
#pragma unroll
                    for (int k = 0; k < VPL; ++k) {
                        const bool valid = t < t_end && (NV % LPR == 0 || col + k * LPR < NV);
                        // When !valid nothing is read, but the address stays an aligned one in the pool.
                        const char* src = kp + (valid ? (col + k * LPR) * 16 : 0);
                        const u32 slot = dst + (r * VPL + k) * 32 * 16;
                        cp_async16(slot, src, valid);
                        cp_async16(slot + SLOTS * 32 * 16, src + v_offset_bytes, valid);
                    }
                }
            }
        }
        cp_async_commit();  // an empty group past the end keeps the group count uniform
    };

    const int step_stride = num_warps * TOK;
    int next = t_begin + warp * TOK;
#pragma unroll
    for (int p = 0; p < STAGES - 1; ++p, next += step_stride) issue(p, next);

    int stage = 0;
    for (int s0 = t_begin + warp * TOK; s0 < t_end; s0 += step_stride) {
        issue(stage == 0 ? STAGES - 1 : stage - 1, next);  // the stage computed last iteration
        next += step_stride;
        cp_async_wait<STAGES - 1>();  // this step's group has landed
        const uint4* kring = ring + (stage * 2) * SLOTS * 32;
        const uint4* vring = kring + SLOTS * 32;

        // Scores: partial dot products, then a butterfly over the LPR lanes of each row.
        float s[ROUNDS][GROUP];
#pragma unroll
        for (int r = 0; r < ROUNDS; ++r) {
            float kf[VPL][EPV];
#pragma unroll
            for (int k = 0; k < VPL; ++k) Dtype<KV>::unpack(kring[(r * VPL + k) * 32], kf[k]);
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                float dot = 0.f;
#pragma unroll
                for (int k = 0; k < VPL; ++k)
#pragma unroll
                    for (int e = 0; e < EPV; ++e) dot = fmaf(q[g][k][e], kf[k][e], dot);
                s[r][g] = dot;
            }
        }
#pragma unroll
        for (int off = LPR / 2; off >= 1; off >>= 1)
#pragma unroll
            for (int r = 0; r < ROUNDS; ++r)
#pragma unroll
                for (int g = 0; g < GROUP; ++g) s[r][g] += __shfl_xor_sync(0xffffffffu, s[r][g], off);

        // Online softmax: one max per step and head (over rounds, then over the warp's rows).
        if (s0 + TOK > t_end) {  // the warp's last step may run past the split: mask those rows
#pragma unroll
            for (int r = 0; r < ROUNDS; ++r)
                if (s0 + r * RPW + row >= t_end) {
#pragma unroll
                    for (int g = 0; g < GROUP; ++g) s[r][g] = neg_inf();
                }
        }
        if constexpr (WINDOWED) {
            if (s0 < lo) {  // the first block's tokens before the window
#pragma unroll
                for (int r = 0; r < ROUNDS; ++r)
                    if (s0 + r * RPW + row < lo) {
#pragma unroll
                        for (int g = 0; g < GROUP; ++g) s[r][g] = neg_inf();
                    }
            }
        }
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            float mx = s[0][g];
#pragma unroll
            for (int r = 1; r < ROUNDS; ++r) mx = fmaxf(mx, s[r][g]);
#pragma unroll
            for (int off = LPR; off < 32; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            // mx is warp-uniform, so is this branch; once the running max settles, steps skip the
            // rescale. Without a window mx is finite (row 0 of round 0 is a real token); with one a
            // step before the window has none, and m stays -inf until a step has.
            if (mx > m[g]) {
                const float alpha = fast_exp2(m[g] - mx);  // 0 on the first step
                m[g] = mx;
                l[g] *= alpha;
#pragma unroll
                for (int k = 0; k < VPL; ++k)
#pragma unroll
                    for (int e = 0; e < EPV; ++e) acc[g][k][e] *= alpha;
            }
            // -inf - -inf would be NaN: with no real token yet every probability is exp2(-inf) = 0.
            const float m_used = WINDOWED && m[g] == neg_inf() ? 0.f : m[g];
#pragma unroll
            for (int r = 0; r < ROUNDS; ++r) {
                s[r][g] = fast_exp2(s[r][g] - m_used);  // now the probability; 0 for masked rows
                l[g] += s[r][g];
            }
        }

#pragma unroll
        for (int r = 0; r < ROUNDS; ++r) {
            float vf[VPL][EPV];
#pragma unroll
            for (int k = 0; k < VPL; ++k) Dtype<KV>::unpack(vring[(r * VPL + k) * 32], vf[k]);
#pragma unroll
            for (int g = 0; g < GROUP; ++g)
#pragma unroll
                for (int k = 0; k < VPL; ++k)
#pragma unroll
                    for (int e = 0; e < EPV; ++e) acc[g][k][e] = fmaf(s[r][g], vf[k][e], acc[g][k][e]);
        }
        stage = stage == STAGES - 1 ? 0 : stage + 1;
    }
    cp_async_wait<0>();

    // Sum l and acc over the warp's rows (m is already warp-uniform).
#pragma unroll
    for (int off = LPR; off < 32; off <<= 1)
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            l[g] += __shfl_xor_sync(0xffffffffu, l[g], off);
#pragma unroll
            for (int k = 0; k < VPL; ++k)
#pragma unroll
                for (int e = 0; e < EPV; ++e) acc[g][k][e] += __shfl_xor_sync(0xffffffffu, acc[g][k][e], off);
        }

    // Merge the warps through shared memory, reusing the rings once every warp is done.
    __syncthreads();
    float* sm_m = reinterpret_cast<float*>(smem + ((split_blocks_max * 8 + 15) & ~15));  // [warps][GROUP]
    float* sm_l = sm_m + num_warps * GROUP;                                                 // [warps][GROUP]
    float* sm_acc = sm_l + num_warps * GROUP;                                               // [warps][GROUP][D]
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            sm_m[warp * GROUP + g] = m[g];
            sm_l[warp * GROUP + g] = l[g];
        }
    }
    if (row == 0) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g)
#pragma unroll
            for (int k = 0; k < VPL; ++k) {
                const int vec = col + k * LPR;
                if (NV % LPR == 0 || vec < NV) {
#pragma unroll
                    for (int e = 0; e < EPV; ++e)
                        sm_acc[(warp * GROUP + g) * HEAD_DIM + vec * EPV + e] = acc[g][k][e];
                }
            }
    }
    __syncthreads();

    for (int i = threadIdx.x; i < heads_here * HEAD_DIM; i += blockDim.x) {
        const int g = i / HEAD_DIM, d = i - g * HEAD_DIM;
        float mx = neg_inf();
        for (int w = 0; w < num_warps; ++w) mx = fmaxf(mx, sm_m[w * GROUP + g]);
        float sum = 0.f, a = 0.f;
        for (int w = 0; w < num_warps; ++w) {
            const float c = fast_exp2(sm_m[w * GROUP + g] - mx);  // 0 for a warp without tokens
            sum += c * sm_l[w * GROUP + g];
            a += c * sm_acc[(w * GROUP + g) * HEAD_DIM + d];
        }
        a *= v_mult;
        const i64 bh = (i64)b * num_heads + head0 + g;
        if (num_splits == 1) {
            out[bh * HEAD_DIM + d] = Dtype<T>::from_float(sum > 0.f ? a / sum : 0.f);
        } else {
            ws_acc[(bh * num_splits + split) * HEAD_DIM + d] = a;
            if (d == 0) {
                ws_ml[(bh * num_splits + split) * 2] = mx;
                ws_ml[(bh * num_splits + split) * 2 + 1] = sum;
            }
        }
    }
}

// grid (num_heads, batch), block >= HEAD_DIM threads: combine the splits that ran into the output.
// Workspace rows are [num_splits] per (batch, head); split s ran iff s * split_tokens < the tokens
// from the splits' start (0, or with a window the block holding its first token) to the row's end.
template <typename T, int HEAD_DIM, bool WINDOWED>
__device__ void paged_decode_reduce(T* __restrict__ out, const float* __restrict__ ws_acc,
                                    const float* __restrict__ ws_ml, const int* __restrict__ seq_lens,
                                    const int* __restrict__ query_lens, int max_tokens,
                                    int split_tokens, int num_splits, int block_size_log2, int window) {
    const int h = blockIdx.x, num_heads = gridDim.x, b = blockIdx.y;
    const int d = threadIdx.x;
    if (d >= HEAD_DIM) return;
    const int n = attended_tokens(seq_lens, query_lens, b, max_tokens);
    int base = 0;
    if constexpr (WINDOWED) base = (max(0, n - window) >> block_size_log2) << block_size_log2;
    const i64 bh = (i64)b * num_heads + h;
    const int ran = min(num_splits, (n - base + split_tokens - 1) / split_tokens);
    const float* ml = ws_ml + bh * num_splits * 2;
    const float* acc = ws_acc + bh * num_splits * HEAD_DIM + d;
    float mx = neg_inf();
    for (int s = 0; s < ran; ++s) mx = fmaxf(mx, ml[2 * s]);
    float sum = 0.f, a = 0.f;
    for (int s = 0; s < ran; ++s) {
        const float c = fast_exp2(ml[2 * s] - mx);
        sum += c * ml[2 * s + 1];
        a += c * acc[(i64)s * HEAD_DIM];
    }
    out[bh * HEAD_DIM + d] = Dtype<T>::from_float(sum > 0.f ? a / sum : 0.f);
}

#define PONYTAIL_DECODE_KERNEL(NAME, T, KV, D, G, L, S, V, WIN, SUFFIX, WINDOW_PARAM, WINDOW_ARG)   \
    extern "C" __global__ void __launch_bounds__(256)                                          \
        paged_decode_##NAME##_d##D##_g##G##_l##L##s##S##v##V##SUFFIX(                          \
            const T* query, i64 q_batch_stride, i64 q_head_stride, T* out, float* ws_acc,      \
            float* ws_ml, const u64* chunk_ptrs, const int* block_tables, int table_stride,    \
            const int* seq_lens, const int* query_lens, int num_kv_heads, int group_size,      \
            int block_size_log2, int chunk_blocks, int num_blocks, int layer, int max_tokens,  \
            int split_tokens, float scale_log2, const T* new_k, const T* new_v,                \
            i64 k_token_stride, i64 k_head_stride, i64 v_token_stride, i64 v_head_stride,      \
            const i64* slots, const float* kv_scales WINDOW_PARAM) {                           \
        paged_decode<T, KV, D, G, L, S, V, WIN>(query, q_batch_stride, q_head_stride, out,     \
                                                ws_acc, ws_ml, chunk_ptrs, block_tables,       \
                                                table_stride, seq_lens, query_lens,            \
                                                num_kv_heads, group_size, block_size_log2,     \
                                                chunk_blocks, num_blocks, layer, max_tokens,   \
                                                split_tokens, scale_log2, new_k, new_v,        \
                                                k_token_stride, k_head_stride, v_token_stride, \
                                                v_head_stride, slots, kv_scales, WINDOW_ARG);  \
    }

#define PONYTAIL_COMMA ,
// Without a window, and with one: the name ends in _w and `window` comes last.
#define PONYTAIL_DECODE(NAME, T, KV, D, G, L, S, V) \
    PONYTAIL_DECODE_KERNEL(NAME, T, KV, D, G, L, S, V, false, , , 0)
#define PONYTAIL_DECODE_WINDOWED(NAME, T, KV, D, G, L, S, V) \
    PONYTAIL_DECODE_KERNEL(NAME, T, KV, D, G, L, S, V, true, _w, PONYTAIL_COMMA int window, window)

#define PONYTAIL_DECODE_REDUCE(NAME, T, D)                                                      \
    extern "C" __global__ void paged_decode_reduce_##NAME##_d##D(                               \
        T* out, const float* ws_acc, const float* ws_ml, const int* seq_lens,                  \
        const int* query_lens, int max_tokens, int split_tokens, int num_splits) {             \
        paged_decode_reduce<T, D, false>(out, ws_acc, ws_ml, seq_lens, query_lens, max_tokens, \
                                         split_tokens, num_splits, 0, 0);                      \
    }
#define PONYTAIL_DECODE_REDUCE_WINDOWED(NAME, T, D)                                             \
    extern "C" __global__ void paged_decode_reduce_##NAME##_d##D##_w(                           \
        T* out, const float* ws_acc, const float* ws_ml, const int* seq_lens,                  \
        const int* query_lens, int max_tokens, int split_tokens, int num_splits,               \
        int block_size_log2, int window) {                                                     \
        paged_decode_reduce<T, D, true>(out, ws_acc, ws_ml, seq_lens, query_lens, max_tokens,  \
                                        split_tokens, num_splits, block_size_log2, window);    \
    }

// One configuration per head size: l4s3v1 (52 KiB of shared memory a CTA, so 4 CTAs of 4 warps
// share an SM), for groups of 1, 2, 4 and 8 query heads. FP8 pools stop at 4: sixteen elements a
// vector double the query and accumulator registers, and 8 heads would spill them.
#define PONYTAIL_DECODE_GROUPS(NAME, T, D)                                                      \
    PONYTAIL_DECODE(NAME, T, T, D, 1, 4, 3, 1)                                                  \
    PONYTAIL_DECODE(NAME, T, T, D, 2, 4, 3, 1)                                                  \
    PONYTAIL_DECODE(NAME, T, T, D, 4, 4, 3, 1)                                                  \
    PONYTAIL_DECODE(NAME, T, T, D, 8, 4, 3, 1)                                                  \
    PONYTAIL_DECODE_REDUCE(NAME, T, D)
#define PONYTAIL_DECODE_WINDOWED_GROUPS(NAME, T, D)                                             \
    PONYTAIL_DECODE_WINDOWED(NAME, T, T, D, 1, 4, 3, 1)                                         \
    PONYTAIL_DECODE_WINDOWED(NAME, T, T, D, 2, 4, 3, 1)                                         \
    PONYTAIL_DECODE_WINDOWED(NAME, T, T, D, 4, 4, 3, 1)                                         \
    PONYTAIL_DECODE_WINDOWED(NAME, T, T, D, 8, 4, 3, 1)                                         \
    PONYTAIL_DECODE_REDUCE_WINDOWED(NAME, T, D)
#define PONYTAIL_DECODE_FP8_GROUPS(NAME, T, D)                                                  \
    PONYTAIL_DECODE(fp8_##NAME, T, fp8_t, D, 1, 4, 3, 1)                                        \
    PONYTAIL_DECODE(fp8_##NAME, T, fp8_t, D, 2, 4, 3, 1)                                        \
    PONYTAIL_DECODE(fp8_##NAME, T, fp8_t, D, 4, 4, 3, 1)                                        \
    PONYTAIL_DECODE_REDUCE(NAME, T, D)
#define PONYTAIL_DECODE_FP8_WINDOWED_GROUPS(NAME, T, D)                                         \
    PONYTAIL_DECODE_WINDOWED(fp8_##NAME, T, fp8_t, D, 1, 4, 3, 1)                               \
    PONYTAIL_DECODE_WINDOWED(fp8_##NAME, T, fp8_t, D, 2, 4, 3, 1)                               \
    PONYTAIL_DECODE_WINDOWED(fp8_##NAME, T, fp8_t, D, 4, 4, 3, 1)                               \
    PONYTAIL_DECODE_REDUCE_WINDOWED(NAME, T, D)

// Every decode head size (attention/decode.py's DECODE_HEAD_DIMS) of one GROUPS macro's kernels.
#define PONYTAIL_FOR_HEAD_SIZES(GROUPS, NAME, T)                                                \
    GROUPS(NAME, T, 64)                                                                         \
    GROUPS(NAME, T, 80)                                                                         \
    GROUPS(NAME, T, 96)                                                                         \
    GROUPS(NAME, T, 128)                                                                        \
    GROUPS(NAME, T, 256)

// Which kernels this compile holds (kernels/loader.py compiles the file once per set of defines
// a pool needs): PONYTAIL_WINDOWED for models with a sliding window, PONYTAIL_FP8 for FP8 pools.
// Models without either never pay those kernels' compile.
#if defined(PONYTAIL_FP8) && defined(PONYTAIL_WINDOWED)
PONYTAIL_FOR_HEAD_SIZES(PONYTAIL_DECODE_FP8_WINDOWED_GROUPS, bf16, bf16_t)
PONYTAIL_FOR_HEAD_SIZES(PONYTAIL_DECODE_FP8_WINDOWED_GROUPS, fp16, fp16_t)
#elif defined(PONYTAIL_FP8)
PONYTAIL_FOR_HEAD_SIZES(PONYTAIL_DECODE_FP8_GROUPS, bf16, bf16_t)
PONYTAIL_FOR_HEAD_SIZES(PONYTAIL_DECODE_FP8_GROUPS, fp16, fp16_t)
#elif defined(PONYTAIL_WINDOWED)
PONYTAIL_FOR_HEAD_SIZES(PONYTAIL_DECODE_WINDOWED_GROUPS, bf16, bf16_t)
PONYTAIL_FOR_HEAD_SIZES(PONYTAIL_DECODE_WINDOWED_GROUPS, fp16, fp16_t)
PONYTAIL_FOR_HEAD_SIZES(PONYTAIL_DECODE_WINDOWED_GROUPS, fp32, float)
#else
PONYTAIL_FOR_HEAD_SIZES(PONYTAIL_DECODE_GROUPS, bf16, bf16_t)
PONYTAIL_FOR_HEAD_SIZES(PONYTAIL_DECODE_GROUPS, fp16, fp16_t)
PONYTAIL_FOR_HEAD_SIZES(PONYTAIL_DECODE_GROUPS, fp32, float)
#endif

// --------------------------------------------------------------------------- prefill gather
// grid (max_blocks, batch): one CTA copies table entry j of row b, K and V, every KV head, into
// k_out / v_out [batch][kv_heads][max_blocks * block_size][row], zero-filling tokens at or past
// the row's seq_len (they may hold anything, NaN included, and SDPA multiplies them by 0).
template <typename V>
__device__ void gather_kv(V* __restrict__ k_out, V* __restrict__ v_out,
                          const u64* __restrict__ chunk_ptrs, const int* __restrict__ block_tables,
                          int table_stride, const int* __restrict__ seq_lens, int num_heads,
                          int row_vecs, int block_size, int chunk_blocks, int num_blocks, int layer) {
    const int j = blockIdx.x, max_blocks = gridDim.x, b = blockIdx.y;
    const int n = seq_lens[b];
    const i64 max_tokens = (i64)max_blocks * block_size;
    const int per_token = num_heads * row_vecs;
    const i64 block_vecs = (i64)block_size * per_token;
    int id = -1;
    if ((i64)j * block_size < n) id = block_tables[(i64)b * table_stride + j];
    if (id >= num_blocks) id = -1;
    const V* k_src = nullptr;
    if (id >= 0) {
        const int chunk = id / chunk_blocks;
        const int within = id - chunk * chunk_blocks;
        k_src = reinterpret_cast<const V*>(chunk_ptrs[chunk]) + ((i64)(2 * layer) * chunk_blocks + within) * block_vecs;
    }
    const i64 v_offset = (i64)chunk_blocks * block_vecs;
    V zero;
    for (int z = 0; z < (int)(sizeof(V) / sizeof(u16)); ++z) reinterpret_cast<u16*>(&zero)[z] = 0;
    for (int i = threadIdx.x; i < block_vecs; i += blockDim.x) {
        const int o = i / per_token;
        const int rem = i - o * per_token;
        const int h = rem / row_vecs;
        const int vec = rem - h * row_vecs;
        const i64 pos = (i64)j * block_size + o;
        const bool live = k_src != nullptr && pos < n;
        const V k = live ? k_src[i] : zero;
        const V v = live ? k_src[v_offset + i] : zero;
        const i64 dst = (((i64)b * num_heads + h) * max_tokens + pos) * row_vecs + vec;
        k_out[dst] = k;
        v_out[dst] = v;
    }
}

// Prefill for flash varlen: row b's first seq_lens[b] tokens land at rows cu_k[b].. of k_out and
// v_out [total, num_heads, head_dim]. That is the blocks' own token-major layout, so each CTA
// copies one block's live tokens as one contiguous, coalesced run. One CTA per (table entry, row).
template <typename V>
__device__ void gather_kv_packed(V* __restrict__ k_out, V* __restrict__ v_out,
                                 const u64* __restrict__ chunk_ptrs, const int* __restrict__ block_tables,
                                 int table_stride, const int* __restrict__ seq_lens,
                                 const int* __restrict__ cu_k, int num_heads, int row_vecs, int block_size,
                                 int chunk_blocks, int num_blocks, int layer) {
    const int j = blockIdx.x, b = blockIdx.y;
    const int n = seq_lens[b];
    const int first = j * block_size;
    if (first >= n) return;
    const int tokens = min(block_size, n - first);
    const int per_token = num_heads * row_vecs;
    const i64 block_vecs = (i64)block_size * per_token;
    int id = block_tables[(i64)b * table_stride + j];
    const V* k_src = nullptr;
    if (id >= 0 && id < num_blocks) {  // a bad id reads nothing outside the pool: zeros instead
        const int chunk = id / chunk_blocks;
        const int within = id - chunk * chunk_blocks;
        k_src = reinterpret_cast<const V*>(chunk_ptrs[chunk]) + ((i64)(2 * layer) * chunk_blocks + within) * block_vecs;
    }
    const i64 v_offset = (i64)chunk_blocks * block_vecs;
    V zero;
    for (int z = 0; z < (int)(sizeof(V) / sizeof(u16)); ++z) reinterpret_cast<u16*>(&zero)[z] = 0;
    const i64 count = (i64)tokens * per_token;
    const i64 dst = ((i64)cu_k[b] + first) * per_token;
    for (i64 i = threadIdx.x; i < count; i += blockDim.x) {
        k_out[dst + i] = k_src != nullptr ? k_src[i] : zero;
        v_out[dst + i] = k_src != nullptr ? k_src[v_offset + i] : zero;
    }
}

#define PONYTAIL_GATHER(SUFFIX, V)                                                              \
    extern "C" __global__ void gather_kv_##SUFFIX(                                              \
        V* k_out, V* v_out, const u64* chunk_ptrs, const int* block_tables, int table_stride,   \
        const int* seq_lens, int num_heads, int row_vecs, int block_size, int chunk_blocks,     \
        int num_blocks, int layer) {                                                            \
        gather_kv<V>(k_out, v_out, chunk_ptrs, block_tables, table_stride, seq_lens,            \
                     num_heads, row_vecs, block_size, chunk_blocks, num_blocks, layer);         \
    }                                                                                           \
    extern "C" __global__ void gather_kv_packed_##SUFFIX(                                       \
        V* k_out, V* v_out, const u64* chunk_ptrs, const int* block_tables, int table_stride,   \
        const int* seq_lens, const int* cu_k, int num_heads, int row_vecs, int block_size,      \
        int chunk_blocks, int num_blocks, int layer) {                                          \
        gather_kv_packed<V>(k_out, v_out, chunk_ptrs, block_tables, table_stride, seq_lens,     \
                            cu_k, num_heads, row_vecs, block_size, chunk_blocks, num_blocks,    \
                            layer);                                                             \
    }

// An FP8 pool's gathers, padded (PACKED false: gather_kv's layout, zeros past seq_len) or packed
// (gather_kv_packed's): the same grids, each thread widening four stored bytes of a row into four
// T elements times the layer's scale. A dequantized copy of the step's rows only, as the bf16
// gathers copy them: nothing of the pool is converted beyond what the step attends.
template <typename T, bool PACKED>
__device__ void gather_kv_fp8(T* __restrict__ k_out, T* __restrict__ v_out, const u64* __restrict__ chunk_ptrs,
                              const int* __restrict__ block_tables, int table_stride,
                              const int* __restrict__ seq_lens, const int* __restrict__ cu_k, int num_heads,
                              int head_dim, int block_size, int chunk_blocks, int num_blocks, int layer,
                              const float* __restrict__ kv_scales) {
    const int j = blockIdx.x, max_blocks = gridDim.x, b = blockIdx.y;
    const int n = seq_lens[b];
    const int first = j * block_size;
    if (PACKED && first >= n) return;
    int id = first < n ? block_tables[(i64)b * table_stride + j] : -1;
    if (id >= num_blocks) id = -1;  // a bad id reads nothing outside the pool: zeros instead
    const i64 block_bytes = (i64)block_size * num_heads * head_dim;
    const u32* k_src = nullptr;
    if (id >= 0) {
        const int chunk = id / chunk_blocks;
        const int within = id - chunk * chunk_blocks;
        k_src = reinterpret_cast<const u32*>(reinterpret_cast<const char*>(chunk_ptrs[chunk]) +
                                             ((i64)(2 * layer) * chunk_blocks + within) * block_bytes);
    }
    const i64 v_offset = (i64)chunk_blocks * block_bytes / 4;  // in words
    const float k_mult = kv_scales[2 * layer] * PONYTAIL_FP8_WIDEN_FACTOR;
    const float v_mult = kv_scales[2 * layer + 1] * PONYTAIL_FP8_WIDEN_FACTOR;
    const int row_words = head_dim / 4;
    const int per_token = num_heads * row_words;
    const int tokens = PACKED ? min(block_size, n - first) : block_size;
    const i64 max_tokens = (i64)max_blocks * block_size;
    for (int i = threadIdx.x; i < tokens * per_token; i += blockDim.x) {
        const int o = i / per_token;
        const int rem = i - o * per_token;
        const int h = rem / row_words;
        const int e = (rem - h * row_words) * 4;
        const i64 pos = first + o;
        float kf[4] = {0.f, 0.f, 0.f, 0.f}, vf[4] = {0.f, 0.f, 0.f, 0.f};
        if (k_src != nullptr && pos < n) {
            fp8x4_widen(k_src[i], kf);
            fp8x4_widen(k_src[v_offset + i], vf);
        }
        const i64 dst = PACKED ? ((i64)(cu_k[b] + pos) * num_heads + h) * head_dim + e
                               : (((i64)b * num_heads + h) * max_tokens + pos) * head_dim + e;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            k_out[dst + w] = Dtype<T>::from_float(kf[w] * k_mult);
            v_out[dst + w] = Dtype<T>::from_float(vf[w] * v_mult);
        }
    }
}

#define PONYTAIL_GATHER_FP8(NAME, T)                                                            \
    extern "C" __global__ void gather_kv_fp8_##NAME(                                            \
        T* k_out, T* v_out, const u64* chunk_ptrs, const int* block_tables, int table_stride,   \
        const int* seq_lens, int num_heads, int head_dim, int block_size, int chunk_blocks,     \
        int num_blocks, int layer, const float* kv_scales) {                                    \
        gather_kv_fp8<T, false>(k_out, v_out, chunk_ptrs, block_tables, table_stride, seq_lens, \
                                nullptr, num_heads, head_dim, block_size, chunk_blocks,         \
                                num_blocks, layer, kv_scales);                                  \
    }                                                                                           \
    extern "C" __global__ void gather_kv_packed_fp8_##NAME(                                     \
        T* k_out, T* v_out, const u64* chunk_ptrs, const int* block_tables, int table_stride,   \
        const int* seq_lens, const int* cu_k, int num_heads, int head_dim, int block_size,      \
        int chunk_blocks, int num_blocks, int layer, const float* kv_scales) {                  \
        gather_kv_fp8<T, true>(k_out, v_out, chunk_ptrs, block_tables, table_stride, seq_lens,  \
                               cu_k, num_heads, head_dim, block_size, chunk_blocks, num_blocks, \
                               layer, kv_scales);                                               \
    }

#if defined(PONYTAIL_FP8) && !defined(PONYTAIL_WINDOWED)
PONYTAIL_GATHER_FP8(bf16, bf16_t)
PONYTAIL_GATHER_FP8(fp16, fp16_t)
#elif !defined(PONYTAIL_FP8) && !defined(PONYTAIL_WINDOWED)
PONYTAIL_GATHER(v16, uint4)
PONYTAIL_GATHER(v8, uint2)
PONYTAIL_GATHER(v4, unsigned int)
PONYTAIL_GATHER(v2, unsigned short)
#endif
