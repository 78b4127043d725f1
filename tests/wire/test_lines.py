"""The LL and LL128 line formats are NCCL v2.19.3-1's (src/include/device.h), written out."""

from gradtap.wire import ll, ll128


def test_ll_line_is_union_ncclLLFifoLine():
    # struct { uint32_t data1, flag1, data2, flag2; }
    assert (ll.LL_DATA1_OFF, ll.LL_FLAG1_OFF, ll.LL_DATA2_OFF, ll.LL_FLAG2_OFF) == (0, 4, 8, 12)
    assert (ll.LL_LINE_BYTES, ll.LL_LINE_DATA_BYTES, ll.LL_HALF_BYTES, ll.LL_FLAG_MASK) == (16, 8, 4, 0xFFFFFFFF)


def test_ll128_line_and_slice():
    # NCCL_LL128_LINESIZE 128, LINEELEMS 16, DATAELEMS 15, SHMEM_ELEMS_PER_THREAD 8, WARP_SIZE 32
    assert (ll128.LL128_LINE_BYTES, ll128.LL128_LINE_WORDS, ll128.LL128_LINE_DATA_WORDS) == (128, 16, 15)
    assert (ll128.LL128_FLAG_WORD, ll128.LL128_FLAG_OFF, ll128.WARP_SIZE) == (15, 120, 32)
    assert (ll128.LL128_SLICE_WIRE_WORDS, ll128.LL128_SLICE_DATA_WORDS, ll128.LL128_SLICE_LINES) == (256, 240, 16)
    assert (ll128.LL128_SLICE_WIRE_BYTES, ll128.LL128_SLICE_DATA_BYTES) == (2048, 1920)


def test_ll128_tables_are_inverse_and_skip_the_flags():
    to_wire, to_data = ll128.LL128_DATA_TO_WIRE, ll128.LL128_WIRE_TO_DATA
    assert (to_data[to_wire] == range(240)).all()
    assert [w for w in range(256) if to_data[w] < 0] == list(range(15, 256, 16))
