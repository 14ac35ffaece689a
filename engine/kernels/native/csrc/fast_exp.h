/* e^x without libm, for loops that must vectorise: shared by paged_decode.c (softmax) and fused_ops.c (SiLU).
 *
 * Where it sits: included by the two kernel sources that kvfleet/engine/kernels/cpu_decode.py compiles
 * into one library (its build key hashes this header too).
 */
#ifndef KVFLEET_FAST_EXP_H
#define KVFLEET_FAST_EXP_H

#include <stdint.h>

/* e^x within 2 ulp for any float x (Cephes' expf, clamped to [-87, 88]: e^-87 ~ 1e-38, e^88 ~ 1.6e38),
 * written without a libm call or a branch so that a loop over a row vectorises. */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    /* n in [-126, 127]: 2^n is a normal float, built from its exponent bits */
    union { float f; int32_t i; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

#endif
