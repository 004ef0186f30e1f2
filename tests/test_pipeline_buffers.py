"""``pipeline.buffers``: one slot read and written in place, and the byte count every
pipeline and summary module prices buffers with."""
import jax
import jax.numpy as jnp

from triax.pipeline.buffers import nbytes, put, shape_bytes, take, tree_bytes


def test_put_writes_one_slot_in_the_buffer_dtype_and_take_reads_it_back():
    buf = put(jnp.zeros((3, 2, 2), jnp.bfloat16), jnp.full((2, 2), 1.5, jnp.float32), 2)
    assert buf.dtype == jnp.bfloat16
    assert take(buf, 2).tolist() == [[1.5, 1.5], [1.5, 1.5]]
    assert float(jnp.abs(buf[:2]).sum()) == 0.0


def test_bytes_count_every_element_at_its_dtype_width():
    sd = jax.ShapeDtypeStruct((4, 8), jnp.bfloat16)
    assert nbytes(sd) == 4 * 8 * 2
    assert nbytes(jnp.zeros((3,), jnp.int8)) == 3
    assert shape_bytes((), jnp.float32) == 4
    assert tree_bytes({"a": jnp.zeros((2, 3)), "b": [sd]}) == 6 * 4 + 64


def test_bytes_of_an_aval_as_jaxpr_split_counts_a_cut():
    closed = jax.make_jaxpr(lambda x: x.astype(jnp.float16) * 2)(jnp.ones((5, 2)))
    assert nbytes(closed.jaxpr.outvars[0].aval) == 5 * 2 * 2
