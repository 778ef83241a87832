// FP8 K/V (OCP E4M3, torch.float8_e4m3fn): the one rounding every writer uses and the widening
// every reader uses. Included by cache_ops.cu and paged_attention.cu; NVRTC finds it through the
// include path kernels/loader.py passes, nvcc beside the including file. No standard headers.
//
// Quantize: stored = e4m3(clamp(x / scale, -448, 448)), rounded to nearest even: exactly
// kv/scales.py's `quantize` (torch's conversion), so the CPU fallback and the kernels store the
// same bytes. Widen: a byte's seven magnitude bits, shifted into a half's exponent and mantissa,
// make a half equal to the E4M3 value / 256 (the biases are 7 and 15), subnormals included; the
// kernels fold the 256 into the layer's scale, so widening costs a byte permute and a mask per
// two values on every architecture, with no conversion table.

#define PONYTAIL_FP8_WIDEN_FACTOR 256.f  // E4M3 value = widened half * this

__device__ __forceinline__ unsigned char fp8_e4m3_quantize(float x, float scale) {
    float y = __fdiv_rn(x, scale);
    if (y != y) return 0x7f;  // NaN stays NaN, as torch's conversion keeps it
    y = fminf(fmaxf(y, -448.f), 448.f);
    const unsigned int sign = (__float_as_uint(y) >> 24) & 0x80u;
    const float a = fabsf(y);
    if (a < 0.015625f)  // below 2^-6: E4M3's subnormals, multiples of 2^-9 (8 of them is 2^-6)
        return (unsigned char)(sign | (unsigned int)__float2int_rn(a * 512.f));
    unsigned int bits = __float_as_uint(a);
    bits += 0x7ffffu + ((bits >> 20) & 1u);  // round to nearest even at the third mantissa bit
    return (unsigned char)(sign | (((bits >> 23) - 120u) << 3) | ((bits >> 20) & 7u));
}

// Four E4M3 bytes of w -> four floats, each its value / PONYTAIL_FP8_WIDEN_FACTOR.
__device__ __forceinline__ void fp8x4_widen(unsigned int w, float* f) {
    const unsigned int lo = __byte_perm(w, 0u, 0x1404);  // halves (byte0 << 8, byte1 << 8)
    const unsigned int hi = __byte_perm(w, 0u, 0x3424);  // halves (byte2 << 8, byte3 << 8)
    const unsigned int h01 = (lo & 0x80008000u) | ((lo >> 1) & 0x3f803f80u);
    const unsigned int h23 = (hi & 0x80008000u) | ((hi >> 1) & 0x3f803f80u);
    asm("{\n\t.reg .b16 a, b;\n\tmov.b32 {a, b}, %2;\n\tcvt.f32.f16 %0, a;\n\tcvt.f32.f16 %1, b;\n\t}"
        : "=f"(f[0]), "=f"(f[1]) : "r"(h01));
    asm("{\n\t.reg .b16 a, b;\n\tmov.b32 {a, b}, %2;\n\tcvt.f32.f16 %0, a;\n\tcvt.f32.f16 %1, b;\n\t}"
        : "=f"(f[2]), "=f"(f[3]) : "r"(h23));
}

// A 16-bit model element as a float: bfloat16 (IS_FP16 false) or float16.
template <bool IS_FP16>
__device__ __forceinline__ float bits16_to_float(unsigned short h) {
    if (IS_FP16) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
        return f;
    }
    return __uint_as_float((unsigned int)h << 16);
}
