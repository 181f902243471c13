"""Wide loads and prefetches for the v4 kernel (chapter 08): a stretch of a float16 or float32
cache row read as one 8- or 16-byte vector instruction, then widened to float32; a cache line
asked into L2 ahead of its use.

numba indexes an array one element at a time: a lane reading 8 float16 values issues 8 two-byte
loads, each with its own 64-bit address arithmetic and negative-index check. `vector_loader(n)`
makes a function that reads `n` consecutive elements as one load (`ld.global.v4.u32` for 8
float16s) and writes them, as float32, into a per-thread (local) array. It is a numba intrinsic: it
emits the LLVM load itself, with the vector's alignment, which numba's element indexing cannot
promise. So the caller must: the first element's byte address a multiple of the vector's bytes
(the launcher checks the cache's address and row length).

`prefetch_l2(array, index)` asks for the 128-byte line holding `array[index]` to be brought into
L2 (PTX `prefetch.L2`): a memory request with no register waiting for it, so it keeps DRAM busy
without the register cost of a load in flight. It changes no value, only when a later load finds
its data.

The simulator cannot run an intrinsic: there `vector_loader` gives a plain Python function that
copies the same elements, and `prefetch_l2` does nothing, so the kernel's source is the same in
both.
"""

from __future__ import annotations

import functools

from minivllm.attention.cuda.simulator import SIMULATOR

MAX_VECTOR_BYTES = 16  # the widest load a CUDA thread issues in one instruction
LINE_BYTES = 128  # what one prefetch brings in


def vector_elements(head_dim: int, itemsize: int, vector_bytes: int) -> int:
    """Elements per vector load: the most that fit in `vector_bytes` (a power of two) and divide
    `head_dim`, so that every row splits into whole vectors."""
    if vector_bytes & (vector_bytes - 1) or not itemsize <= vector_bytes <= MAX_VECTOR_BYTES:
        raise ValueError(
            f"vector_bytes must be a power of two from {itemsize} to {MAX_VECTOR_BYTES}, "
            f"got {vector_bytes}"
        )
    elements = vector_bytes // itemsize
    while head_dim % elements:
        elements //= 2
    return elements


@functools.cache
def vector_loader(elements: int):
    """`load(dst, dst_start, src, src_start)`: `dst[dst_start + i] = float32(src[src_start + i])`
    for i < `elements`, as one vector load of `src` (1-D, float16 or float32, C-contiguous)."""
    if SIMULATOR:

        def load(dst, dst_start, src, src_start):
            for i in range(elements):
                dst[dst_start + i] = src[src_start + i]

        return load
    return _vector_load_intrinsic(elements)


def _vector_load_intrinsic(elements: int):
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def load(typingctx, dst, dst_start, src, src_start):
        if not (
            isinstance(dst, types.Array)
            and dst.dtype == types.float32
            and isinstance(src, types.Array)
            and src.ndim == 1
            and src.layout == "C"
            and src.dtype in (types.float16, types.float32)
            and isinstance(dst_start, types.Integer)
            and isinstance(src_start, types.Integer)
        ):
            return None  # numba then reports the types it could not match
        vector_bytes = elements * src.dtype.bitwidth // 8
        if vector_bytes & (vector_bytes - 1) or vector_bytes > MAX_VECTOR_BYTES:
            raise ValueError(f"a vector load of {vector_bytes} bytes is not one instruction")

        def codegen(context, builder, signature, args):
            dst_type, dst_start_type, src_type, src_start_type = signature.args
            dst_value, dst_index, src_value, src_index = args
            source = context.make_array(src_type)(context, builder, value=src_value)
            target = context.make_array(dst_type)(context, builder, value=dst_value)
            src_index = context.cast(builder, src_index, src_start_type, types.intp)
            dst_index = context.cast(builder, dst_index, dst_start_type, types.intp)
            # No wraparound, no bounds check: the caller's offsets are non-negative and in range.
            first = builder.gep(source.data, [src_index])
            if src_type.dtype == types.float32:
                vector_type = ir.VectorType(ir.FloatType(), elements)
            else:  # float16 pairs as 32-bit words (numba keeps a float16 as an i16)
                vector_type = ir.VectorType(ir.IntType(32), max(elements // 2, 1))
                if elements == 1:
                    vector_type = ir.VectorType(ir.IntType(16), 1)
            pointer = builder.bitcast(first, vector_type.as_pointer())
            vector = builder.load(pointer, align=vector_bytes)
            values = []
            for word in range(vector_type.count):
                item = builder.extract_element(vector, ir.Constant(ir.IntType(32), word))
                if src_type.dtype == types.float32:
                    values.append(item)
                elif elements == 1:
                    values.append(_half_to_float(builder, item))
                else:
                    low = builder.trunc(item, ir.IntType(16))
                    high = builder.trunc(builder.lshr(item, ir.Constant(item.type, 16)), low.type)
                    values += [_half_to_float(builder, low), _half_to_float(builder, high)]
            for i, value in enumerate(values):
                index = builder.add(dst_index, ir.Constant(dst_index.type, i))
                builder.store(value, builder.gep(target.data, [index]))
            return context.get_dummy_value()

        return types.void(dst, dst_start, src, src_start), codegen

    return load


def _half_to_float(builder, bits):
    """A float16's bits (i16) as a float32, by the instruction numba itself uses for the cast."""
    from llvmlite import ir

    convert = ir.InlineAsm(
        ir.FunctionType(ir.FloatType(), [ir.IntType(16)]), "cvt.f32.f16 $0, $1;", "=f,h"
    )
    return builder.call(convert, [bits])


def _prefetch_intrinsic():
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def prefetch_l2(typingctx, array, index):
        if not (
            isinstance(array, types.Array) and array.ndim == 1 and isinstance(index, types.Integer)
        ):
            return None

        def codegen(context, builder, signature, args):
            array_type, index_type = signature.args
            data = context.make_array(array_type)(context, builder, value=args[0]).data
            address = builder.gep(data, [context.cast(builder, args[1], index_type, types.intp)])
            pointer = builder.ptrtoint(address, ir.IntType(64))
            fetch = ir.InlineAsm(
                ir.FunctionType(ir.VoidType(), [ir.IntType(64)]),
                "prefetch.L2 [$0];",
                "l",
                side_effect=True,
            )
            builder.call(fetch, [pointer])
            return context.get_dummy_value()

        return types.void(array, index), codegen

    return prefetch_l2


if SIMULATOR:

    def prefetch_l2(array, index):
        """The simulator has no caches: nothing to do."""

else:
    prefetch_l2 = _prefetch_intrinsic()
