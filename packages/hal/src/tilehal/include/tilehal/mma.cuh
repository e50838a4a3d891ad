// Warp-level tensor-core helpers (sm_80+, run on sm_90 too): ldmatrix and mma.sync.
//
// Fragment layouts follow the PTX ISA ("Matrix fragments for mma.m16n8k16"): for a lane l,
// g = l / 4 and q = l % 4. The m16n8 fp32/int32 accumulator holds c0,c1 at (g, 2q + {0,1}) and
// c2,c3 at (g + 8, 2q + {0,1}).
#pragma once
#include "common.cuh"

namespace tilehal {

// ---------------------------------------------------------------- ldmatrix (shared -> registers)
// Each lane passes the shared-memory address of one 16-byte row: lanes 8*i .. 8*i+7 give the
// rows of matrix i. `.trans` transposes every 8x8 matrix of 16-bit elements.
TILEHAL_DEVICE void ldmatrix_x4(u32 (&r)[4], const void* smem_row) {
  u32 a = static_cast<u32>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
TILEHAL_DEVICE void ldmatrix_x4_trans(u32 (&r)[4], const void* smem_row) {
  u32 a = static_cast<u32>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
// The same from a shared-space address (__cvta_generic_to_shared of the tile once, then 32-bit
// offset arithmetic, e.g. a swizzled row), ordered against the kernel's shared-memory accesses
// ("memory" clobber) since the compiler cannot see which bytes an address names.
TILEHAL_DEVICE void ldmatrix_x4(u32 (&r)[4], u32 smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr) : "memory");
}
TILEHAL_DEVICE void ldmatrix_x4_trans(u32 (&r)[4], u32 smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr) : "memory");
}
TILEHAL_DEVICE void ldmatrix_x2(u32 (&r)[2], const void* smem_row) {
  u32 a = static_cast<u32>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
}
TILEHAL_DEVICE void ldmatrix_x2_trans(u32 (&r)[2], const void* smem_row) {
  u32 a = static_cast<u32>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
}

// ---------------------------------------------------------------- mma.sync
// D = A * B + C for one m16n8 tile; A row-major (4 regs), B column-major (2 regs), C/D 4 x fp32.
struct MmaF16 {};
struct MmaBF16 {};
struct MmaE4M3 {};
struct MmaE5M2 {};
struct MmaS8 {};
// The 16-bit operand tag of an element type, for kernels templated over bf16 / fp16.
template <typename T> struct MmaTag;
template <> struct MmaTag<__half> { using type = MmaF16; };
template <> struct MmaTag<__nv_bfloat16> { using type = MmaBF16; };

TILEHAL_DEVICE void mma_m16n8k16(MmaF16, float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
TILEHAL_DEVICE void mma_m16n8k16(MmaBF16, float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// 8-bit operands: m16n8k32 (A: 16x32 row-major, B: 32x8 column-major, 4 elements per register).
TILEHAL_DEVICE void mma_m16n8k32(MmaE4M3, float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
TILEHAL_DEVICE void mma_m16n8k32(MmaE5M2, float (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e5m2.e5m2.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
TILEHAL_DEVICE void mma_m16n8k32(MmaS8, int (&d)[4], const u32 (&a)[4], const u32 (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// ---------------------------------------------------------------- packing register operands
// Two 16-bit values (low, high) from fp32, rounded to nearest: an A operand built from an
// accumulator (flash attention's P @ V).
TILEHAL_DEVICE u32 pack2(MmaF16, float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<u32*>(&v);
}
TILEHAL_DEVICE u32 pack2(MmaBF16, float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<u32*>(&v);
}
TILEHAL_DEVICE u32 pack2_bits(__half lo, __half hi) {
  return static_cast<u32>(__half_as_ushort(lo)) | (static_cast<u32>(__half_as_ushort(hi)) << 16);
}
TILEHAL_DEVICE u32 pack2_bits(__nv_bfloat16 lo, __nv_bfloat16 hi) {
  return static_cast<u32>(__bfloat16_as_ushort(lo)) | (static_cast<u32>(__bfloat16_as_ushort(hi)) << 16);
}

}  // namespace tilehal
