"""Eight-float vectors for numba kernels: a register type and the handful of operations the CPU
attention kernel needs (chapter 07).

numba's compiler, LLVM, vectorises a plain loop along contiguous memory, but a kernel cannot tell it
*how*: a dot product along `head_dim` becomes SIMD multiply-adds and then, for every (key, query)
pair, a sum across the eight lanes -- as much work as the multiply-adds themselves at head_dim 32.
With these a kernel says where the lanes go, the way C++ kernels do with intrinsics (vLLM's CPU
build wraps them as `vec_op`): `float32x8` is an LLVM `<8 x float>` held in a register, and each
function below is one or a few LLVM instructions, written out by `numba.extending.intrinsic`.

They are LLVM's portable vector operations, not x86 ones: with AVX2 a `float32x8` is one ymm
register and `fma8` one `vfmadd` instruction; on ARM, LLVM splits it into two 4-lane NEON halves.

`load8` also reads a bfloat16 array -- handed over as its bits, int16 -- into float32 lanes, exactly
(`as_float32` one element): a bfloat16 K/V cache is read at two bytes an element, and the kernel
computes in float32 as it does over a float32 cache. `as_element` goes the other way, for one
result written into a bfloat16 output (rounded as torch rounds).

Where the CPU has AVX-512 BF16 (`BFLOAT16_DOTS`), `dot16` multiplies bfloat16s themselves: sixteen
pairs of them, read as they are stored (`load16`), in one instruction (`vdpbf16ps`), summed into
eight float32 lanes -- twice the multiply-adds of one `fma8`, and nothing widened.

Arrays given to `load8`, `load16`, `store8` and `prefetch` must be one-dimensional and
C-contiguous (a row of a larger array is); like the kernels' other loads, they are not
bounds-checked. numba's on-disk cache tracks the file of the function it compiled, not this one:
after editing this file, clear the `__pycache__` beside the kernel.
"""

from __future__ import annotations

from llvmlite import binding, ir
from numba import types
from numba.core import cgutils, config
from numba.core.codegen import get_host_cpu_features
from numba.extending import intrinsic, models, register_model

VECTOR = ir.VectorType(ir.FloatType(), 8)
_IN_MEMORY = ir.ArrayType(ir.FloatType(), 8)
_INT32 = ir.IntType(32)
BFLOAT16_PAIRS = ir.VectorType(ir.IntType(16), 16)  # sixteen bfloat16s, as their bits


def _cpu_features() -> list[str]:
    """The features numba compiles for: its NUMBA_CPU_FEATURES setting, else the host's (as
    numba's own codegen picks them)."""
    features = get_host_cpu_features() if config.CPU_FEATURES is None else config.CPU_FEATURES
    return features.split(",")


# Whether `dot16` can run: the CPU multiplies bfloat16s (AVX-512 BF16, in AVX-512's 256-bit form).
BFLOAT16_DOTS = {"+avx512bf16", "+avx512vl"} <= set(_cpu_features())


class Float32x8Type(types.Type):
    """Eight float32 lanes in one register."""

    def __init__(self) -> None:
        super().__init__(name="float32x8")


float32x8 = Float32x8Type()


class Bfloat16x16Type(types.Type):
    """Sixteen bfloat16s in one register, as their bits: `dot16`'s operands."""

    def __init__(self) -> None:
        super().__init__(name="bfloat16x16")


bfloat16x16 = Bfloat16x16Type()


@register_model(Bfloat16x16Type)
class _Bfloat16x16Model(models.PrimitiveModel):
    """An LLVM `<16 x i16>`: `load16` makes them and `dot16` takes them, in registers only."""

    def __init__(self, dmm, fe_type) -> None:
        super().__init__(dmm, fe_type, BFLOAT16_PAIRS)


@register_model(Float32x8Type)
class _Float32x8Model(models.PrimitiveModel):
    """In registers an LLVM `<8 x float>`; in memory (a list, a boxed tuple) eight plain floats.
    LLVM assumes a stored `<8 x float>` is aligned to 32 bytes and may use an instruction that
    faults when it is not, and numba's containers promise no such alignment."""

    def __init__(self, dmm, fe_type) -> None:
        super().__init__(dmm, fe_type, VECTOR)

    def get_data_type(self):
        return _IN_MEMORY

    def as_data(self, builder, value):
        lanes = ir.Constant(_IN_MEMORY, ir.Undefined)
        for i in range(8):
            lanes = builder.insert_value(lanes, builder.extract_element(value, _INT32(i)), i)
        return lanes

    def from_data(self, builder, value):
        vector = ir.Constant(VECTOR, ir.Undefined)
        for i in range(8):
            vector = builder.insert_element(vector, builder.extract_value(value, i), _INT32(i))
        return vector


def _element_pointer(context, builder, array_type, array, index):
    """The address of `array[index]` (an LLVM pointer to one float32)."""
    view = context.make_array(array_type)(context, builder, array)
    return cgutils.get_item_pointer(context, builder, array_type, view, [index], wraparound=False)


def _shuffle(builder, a, b, lanes):
    """Lanes picked from `a` (0-7) and `b` (8-15): LLVM's shufflevector."""
    mask = ir.Constant(ir.VectorType(_INT32, len(lanes)), list(lanes))
    return builder.shuffle_vector(a, b, mask)


def _widen_bfloat16(builder, bits, lanes: int | None):
    """bfloat16 bits (an LLVM i16, or `lanes` of them) as the float32s they are: a bfloat16 is a
    float32's upper half, so the bits move up 16 places and the lower half is zero. Exact."""
    wide = _INT32 if lanes is None else ir.VectorType(_INT32, lanes)
    shift = _INT32(16) if lanes is None else ir.Constant(wide, [16] * lanes)
    shifted = builder.shl(builder.zext(bits, wide), shift)
    return builder.bitcast(shifted, ir.FloatType() if lanes is None else VECTOR)


def _holds_bfloat16(array) -> bool:
    """Whether a kernel's array holds bfloat16 bits: numpy has no bfloat16, so a bfloat16 tensor
    reaches numba as its bits, `tensor.view(torch.int16).numpy()`."""
    return array.dtype == types.int16


@intrinsic
def load8(typingctx, array, index):
    """`array[index : index + 8]` as a vector: float32, or bfloat16 bits (an int16 array) widened
    to float32 on the way, two bytes read per lane instead of four."""
    bfloat16 = _holds_bfloat16(array)

    def codegen(context, builder, signature, args):
        pointer = _element_pointer(context, builder, signature.args[0], *args)
        if not bfloat16:
            return builder.load(builder.bitcast(pointer, VECTOR.as_pointer()), align=4)
        halves = builder.bitcast(pointer, ir.VectorType(ir.IntType(16), 8).as_pointer())
        return _widen_bfloat16(builder, builder.load(halves, align=2), 8)

    return float32x8(array, index), codegen


@intrinsic
def load16(typingctx, array, index):
    """`array[index : index + 16]` of an array of bfloat16 bits (int16), as they are: `dot16`'s
    operand. (A float32 array's 32 bytes there are read as they are too: a kernel compiled for a
    float32 cache types its bfloat16 branch, which never runs.)"""
    if array.dtype not in (types.int16, types.float32):
        return None

    def codegen(context, builder, signature, args):
        pointer = _element_pointer(context, builder, signature.args[0], *args)
        return builder.load(builder.bitcast(pointer, BFLOAT16_PAIRS.as_pointer()), align=2)

    return bfloat16x16(array, index), codegen


@intrinsic
def as_float32(typingctx, value):
    """A float32 as it is, or bfloat16 bits (int16, an element of such an array) as the float32
    they stand for: what the kernels' plain loops read their K/V elements through."""
    if value not in (types.float32, types.int16):
        return None

    def codegen(context, builder, signature, args):
        return args[0] if value == types.float32 else _widen_bfloat16(builder, args[0], None)

    return types.float32(value), codegen


@intrinsic
def as_element(typingctx, array, value):
    """A float32 `value` as an element of `array`: as it is for a float32 array, or rounded to
    bfloat16 for bfloat16 bits (int16) -- to nearest, ties to even, as torch rounds a float32
    to bfloat16 (`tensor.to(torch.bfloat16)`; a NaN stays a NaN). What a kernel writes its float32
    results through into an output of either dtype."""
    if value != types.float32:
        return None
    bfloat16 = _holds_bfloat16(array)

    def codegen(context, builder, signature, args):
        value = args[1]
        if not bfloat16:
            return value
        bits = builder.bitcast(value, _INT32)
        # bits + 0x7FFF + (bit 16 of bits): rounds the lower half away, ties to the even upper half
        odd = builder.and_(builder.lshr(bits, _INT32(16)), _INT32(1))
        rounded = builder.add(bits, builder.add(_INT32(0x7FFF), odd))
        upper = builder.trunc(builder.lshr(rounded, _INT32(16)), ir.IntType(16))
        is_nan = builder.fcmp_unordered("uno", value, value)
        return builder.select(is_nan, ir.IntType(16)(0x7FC0), upper)

    return (types.int16 if bfloat16 else types.float32)(array, value), codegen


@intrinsic
def store8(typingctx, array, index, vector):
    """`array[index : index + 8] = vector`."""

    def codegen(context, builder, signature, args):
        pointer = _element_pointer(context, builder, signature.args[0], args[0], args[1])
        builder.store(args[2], builder.bitcast(pointer, VECTOR.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(array, index, float32x8), codegen


@intrinsic
def splat8(typingctx, value):
    """One float32 in all eight lanes."""

    def codegen(context, builder, signature, args):
        one = builder.insert_element(ir.Constant(VECTOR, ir.Undefined), args[0], _INT32(0))
        return _shuffle(builder, one, one, [0] * 8)

    return float32x8(types.float32), codegen


@intrinsic
def zero8(typingctx):
    """Eight zeros."""

    def codegen(context, builder, signature, args):
        return ir.Constant(VECTOR, [0.0] * 8)

    return float32x8(), codegen


@intrinsic
def fma8(typingctx, a, b, c):
    """`a * b + c` lane by lane, one rounding (a fused multiply-add)."""

    def codegen(context, builder, signature, args):
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(VECTOR, [VECTOR] * 3), "llvm.fma.v8f32"
        )
        return builder.call(fma, args)

    return float32x8(float32x8, float32x8, float32x8), codegen


@intrinsic
def dot16(typingctx, acc, a, b):
    """`acc` plus, in lane i, a[2i] * b[2i] + a[2i + 1] * b[2i + 1], of sixteen bfloat16s each:
    x86's `vdpbf16ps` (AVX-512 BF16; only where `BFLOAT16_DOTS`). The products are exact (a
    product of two bfloat16s fits a float32) and each is added in float32, rounded to nearest;
    denormal inputs count as zero and denormal results become zero. Written as that instruction
    itself: the LLVM this numba ships has its intrinsic, but llvmlite cannot spell its bfloat16
    vector operands. On another CPU, whose assembler would refuse the instruction, the same sums
    in plain vector arithmetic (the odd pairs' products added first, as Intel describes it): a
    kernel compiles there, and `vector_paths` does not pick the path that would run it."""

    def codegen(context, builder, signature, args):
        if BFLOAT16_DOTS:
            kind = ir.FunctionType(VECTOR, [VECTOR, BFLOAT16_PAIRS, BFLOAT16_PAIRS])
            # AT&T operand order: $0 (= acc, "0") += $2 . $3; "v": any of AVX-512's 32 registers
            instruction = ir.InlineAsm(kind, "vdpbf16ps $3, $2, $0", "=v,0,v,v")
            return builder.call(instruction, list(args))
        total, a, b = args
        for lanes in ([1, 3, 5, 7, 9, 11, 13, 15], [0, 2, 4, 6, 8, 10, 12, 14]):
            x, y = (_widen_bfloat16(builder, _shuffle(builder, v, v, lanes), 8) for v in (a, b))
            total = builder.fadd(total, builder.fmul(x, y))
        return total

    return float32x8(float32x8, bfloat16x16, bfloat16x16), codegen


@intrinsic
def mul8(typingctx, a, b):
    """`a * b` lane by lane."""

    def codegen(context, builder, signature, args):
        return builder.fmul(*args)

    return float32x8(float32x8, float32x8), codegen


@intrinsic
def add8(typingctx, a, b):
    """`a + b` lane by lane."""

    def codegen(context, builder, signature, args):
        return builder.fadd(*args)

    return float32x8(float32x8, float32x8), codegen


@intrinsic
def max8(typingctx, a, b):
    """The larger of `a` and `b` lane by lane (LLVM's `maxnum`: one `vmaxps`)."""

    def codegen(context, builder, signature, args):
        maxnum = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(VECTOR, [VECTOR] * 2), "llvm.maxnum.v8f32"
        )
        return builder.call(maxnum, args)

    return float32x8(float32x8, float32x8), codegen


@intrinsic
def largest_lane(typingctx, a):
    """The largest of the eight lanes (three maxima of halves, as LLVM reduces a vector)."""

    def codegen(context, builder, signature, args):
        reduce = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(ir.FloatType(), [VECTOR]),
            "llvm.vector.reduce.fmax.v8f32",
        )
        return builder.call(reduce, args)

    return types.float32(float32x8), codegen


@intrinsic
def sum8x8(typingctx, a0, a1, a2, a3, a4, a5, a6, a7):
    """Lane i of the result is the sum of the lanes of `a_i`: eight horizontal sums for the price
    of seven additions and fourteen shuffles, where one at a time costs three additions each."""

    def codegen(context, builder, signature, args):
        def halve(x, y, low, high):  # add the lane pairs `low`/`high` of x and y, interleaved
            return builder.fadd(_shuffle(builder, x, y, low), _shuffle(builder, x, y, high))

        # Round 1, neighbours: [x0+x1, y0+y1, x2+x3, y2+y3, ...] for the pairs (a0,a1), (a2,a3)...
        even, odd = [0, 8, 2, 10, 4, 12, 6, 14], [1, 9, 3, 11, 5, 13, 7, 15]
        pairs = [halve(args[i], args[i + 1], even, odd) for i in range(0, 8, 2)]
        # Round 2, pairs of pairs: per 128-bit half, [a0 a1 a2 a3] partial sums of four lanes.
        low, high = [0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15]
        quads = [halve(pairs[0], pairs[1], low, high), halve(pairs[2], pairs[3], low, high)]
        # Round 3, the two 128-bit halves: [a0 .. a7], each a full sum.
        return halve(quads[0], quads[1], [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])

    return float32x8(*[float32x8] * 8), codegen


def _prefetch(locality: int):
    """The code of a prefetch of `array[index]`'s line with LLVM's locality hint: 3 keeps it in
    every cache level (x86 `prefetcht0`), 2 in the second level and beyond (`prefetcht1`)."""

    def codegen(context, builder, signature, args):
        pointer = _element_pointer(context, builder, signature.args[0], *args)
        byte_pointer = builder.bitcast(pointer, ir.IntType(8).as_pointer())
        hint = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(ir.VoidType(), [byte_pointer.type, _INT32, _INT32, _INT32]),
            "llvm.prefetch.p0i8",
        )
        builder.call(hint, [byte_pointer, _INT32(0), _INT32(locality), _INT32(1)])
        return context.get_dummy_value()

    return codegen


@intrinsic
def prefetch(typingctx, array, index):
    """Ask the caches for the line holding `array[index]` now, without waiting for it: a hint
    (LLVM's `llvm.prefetch`: for reading, keep in every cache level); it never faults."""
    return types.void(array, index), _prefetch(3)


@intrinsic
def prefetch_l2(typingctx, array, index):
    """`prefetch` into the second-level cache, not the first: for a line wanted later, which
    would take the place of lines the first level needs now."""
    return types.void(array, index), _prefetch(2)


# numba's compiler turns machine code written as text (`dot16`'s instruction) into bytes through
# LLVM's assembler, which numba itself never asks for.
binding.initialize_native_asmparser()
