// tinyknn: wgmma.mma_async wrappers (sm_90a) for the Hopper screen (screen_hopper.cuh): d (+)= A B^T with
// A = 64 x K and B = N x K both read from shared memory through descriptors (K-major), accumulators in
// registers (N / 2 per thread). K is 16 (fp16, bf16; f32 accumulate) or 32 (uint8, int8; s32 accumulate):
// 32 bytes of K per instruction either way. scale_d = 0 writes d = A B^T (a tile's first instruction).
// One macro makes each (type, N) wrapper; the register lists are spelled out because inline PTX needs
// every accumulator as its own operand.
#pragma once

namespace tinyknn {

#define TINYKNN_WG8(C, i) C(d[i]), C(d[i + 1]), C(d[i + 2]), C(d[i + 3]), C(d[i + 4]), C(d[i + 5]), C(d[i + 6]), C(d[i + 7])
#define TINYKNN_WG64(C, i) TINYKNN_WG8(C, i), TINYKNN_WG8(C, i + 8), TINYKNN_WG8(C, i + 16), TINYKNN_WG8(C, i + 24), \
  TINYKNN_WG8(C, i + 32), TINYKNN_WG8(C, i + 40), TINYKNN_WG8(C, i + 48), TINYKNN_WG8(C, i + 56)
#define TINYKNN_WG_OPS_64(C) TINYKNN_WG64(C, 0)
#define TINYKNN_WG_OPS_128(C) TINYKNN_WG64(C, 0), TINYKNN_WG64(C, 64)
#define TINYKNN_WG_REGS_64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define TINYKNN_WG_REGS_128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
// The operands after the accumulators: descriptor a, descriptor b, scale_d.
#define TINYKNN_WG_TAIL_64 "%64, %65, p"
#define TINYKNN_WG_TAIL_128 "%128, %129, p"
#define TINYKNN_WG_SCALE_64 "%66"
#define TINYKNN_WG_SCALE_128 "%130"

// NAME(d, a, b, scale_d) for m64 N k (16 | 32) of TYPES; REGS = N / 2 accumulators of C type T, constraint C;
// MORE: the float types' immediate scale-a, scale-b, transpose-a, transpose-b (none for the integer types).
#define TINYKNN_WGMMA(NAME, N, K, TYPES, T, C, REGS, MORE)                                                    \
  TINYKNN_D void NAME(T (&d)[REGS], unsigned long long a, unsigned long long b, int scale_d) {               \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " TINYKNN_WG_SCALE_##REGS ", 0;\n"                        \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k" #K "." TYPES " " TINYKNN_WG_REGS_##REGS ", "     \
                 TINYKNN_WG_TAIL_##REGS MORE ";\n}\n"                                                       \
                 : TINYKNN_WG_OPS_##REGS(C)                                                                   \
                 : "l"(a), "l"(b), "r"(scale_d));                                                             \
  }

TINYKNN_WGMMA(wgmma_f16_n128, 128, 16, "f32.f16.f16", float, "+f", 64, ", 1, 1, 0, 0")
TINYKNN_WGMMA(wgmma_f16_n256, 256, 16, "f32.f16.f16", float, "+f", 128, ", 1, 1, 0, 0")
TINYKNN_WGMMA(wgmma_bf16_n128, 128, 16, "f32.bf16.bf16", float, "+f", 64, ", 1, 1, 0, 0")
TINYKNN_WGMMA(wgmma_bf16_n256, 256, 16, "f32.bf16.bf16", float, "+f", 128, ", 1, 1, 0, 0")
TINYKNN_WGMMA(wgmma_u8_n128, 128, 32, "s32.u8.u8", int, "+r", 64, "")
TINYKNN_WGMMA(wgmma_u8_n256, 256, 32, "s32.u8.u8", int, "+r", 128, "")
TINYKNN_WGMMA(wgmma_s8_n128, 128, 32, "s32.s8.s8", int, "+r", 64, "")
TINYKNN_WGMMA(wgmma_s8_n256, 256, 32, "s32.s8.s8", int, "+r", 128, "")

}  // namespace tinyknn
