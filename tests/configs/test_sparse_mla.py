"""The split plans of the sparse MLA decode launchers (``nsa_backend/configs/sparse_mla.py``): pure functions of the
shapes, checked here on their properties rather than through a launch."""

from __future__ import annotations

import itertools

import pytest

from nsa_backend.configs.sparse_mla import (
    MAX_SPLITS,
    MIN_KEYS_PER_SPLIT,
    decode_num_splits,
    one_wave_splits,
    split_keys,
    wave_filling_splits,
)

CASES = list(itertools.product([1, 64, 100, 2048, 2049], [1, 2, 3, 7, 64], [32, 64]))


@pytest.mark.parametrize("topk, num_splits, block_n", CASES)
def test_split_keys_covers_the_list_with_whole_tiles(topk, num_splits, block_n):
    splits, per = split_keys(topk, num_splits, block_n)
    assert per % block_n == 0
    assert 1 <= splits <= num_splits
    # every key has a split and no split is empty
    assert splits * per >= topk > (splits - 1) * per


@pytest.mark.parametrize("rows, head_blocks, num_sms", [(1, 1, 132), (4, 2, 132), (32, 2, 170), (128, 4, 132),
                                                        (7, 3, 84), (1, 1, 8)])
def test_one_wave_splits_fills_one_wave(rows, head_blocks, num_sms):
    splits, per = one_wave_splits(rows, head_blocks, 2048, 32, num_sms)
    assert (splits, per) == decode_num_splits(rows, head_blocks, 2048, 32, num_sms, programs_per_sm=1)
    assert splits * per >= 2048 and per % 32 == 0
    assert splits <= MAX_SPLITS and per >= MIN_KEYS_PER_SPLIT
    # one program per SM: the programs of all splits make at most one wave, unless one split already overfills it
    assert rows * head_blocks * splits <= num_sms or splits == 1


def test_one_wave_splits_takes_the_callers_count():
    assert one_wave_splits(1, 1, 2048, 32, 132, num_splits=3) == split_keys(2048, 3, 32) == (3, 704)
    assert one_wave_splits(128, 4, 2048, 32, 132, num_splits=2) == (2, 1024)
    assert one_wave_splits(1, 1, 64, 32, 132, num_splits=1) == (1, 64)


@pytest.mark.parametrize("rows, head_blocks, num_sms", [(32, 2, 170), (64, 1, 132), (128, 1, 132), (64, 1, 170),
                                                        (16, 4, 132), (128, 4, 132), (1, 1, 8)])
def test_wave_filling_splits_keeps_a_wave_that_fills(rows, head_blocks, num_sms):
    # where one split's programs fill the GPU or several splits make one full wave, the one-wave plan stands
    assert wave_filling_splits(rows, head_blocks, 2048, 32, num_sms) == one_wave_splits(rows, head_blocks, 2048, 32,
                                                                                          num_sms)


# (rows, head blocks, SMs, top-k) -> splits where the one-wave plan leaves part of the GPU idle. On 132 SMs the counts
# the split sweeps under the proxy found fastest (bench/results/h100-proxy-sm120/: sweeps-splits, B 40-200, the fp8
# decode 1.24-1.30x; splits-small-batches, B 1-16, 1.04-1.52x, below MIN_KEYS_PER_SPLIT keys a split); then what the
# estimate takes on an RTX 5090, an RTX PRO 6000 and a GB10 (170 / 188 / 48 SMs) at partly filled waves
WAVE_FILLING = [((80, 1, 132, 2048), 3), ((40, 2, 132, 2048), 3), ((40, 4, 132, 2048), 4), ((80, 2, 132, 2048), 4),
                ((1, 1, 132, 2048), 22), ((1, 4, 132, 2048), 16), ((4, 1, 132, 2048), 16), ((2, 2, 132, 2048), 16),
                ((1, 1, 132, 512), 8), ((4, 4, 132, 512), 8), ((16, 1, 132, 512), 8), ((40, 1, 132, 512), 3),
                ((100, 1, 170, 2048), 5), ((200, 1, 188, 2048), 4), ((64, 1, 48, 2048), 3)]


@pytest.mark.parametrize("shape, splits", WAVE_FILLING)
def test_wave_filling_splits_fills_the_idle_part(shape, splits):
    rows, head_blocks, num_sms, topk = shape
    got, per = wave_filling_splits(rows, head_blocks, topk, 32, num_sms)
    assert got == splits and got > one_wave_splits(rows, head_blocks, topk, 32, num_sms)[0]
    assert (got, per) == split_keys(topk, got, 32)


@pytest.mark.parametrize("rows, head_blocks, num_sms, topk", itertools.product(
    [1, 7, 40, 80, 100, 160, 200, 256, 1000], [1, 2, 4], [48, 132, 170, 188], [512, 2048]))
def test_wave_filling_splits_stays_in_bounds(rows, head_blocks, num_sms, topk):
    splits, per = wave_filling_splits(rows, head_blocks, topk, 32, num_sms)
    one_wave, _ = one_wave_splits(rows, head_blocks, topk, 32, num_sms)
    # at least the one-wave plan's count, at most one tile a split and MAX_SPLITS
    assert one_wave <= splits <= min(MAX_SPLITS, topk // 32)
    assert splits * per >= topk > (splits - 1) * per and per % 32 == 0


def test_wave_filling_splits_takes_the_callers_count():
    assert wave_filling_splits(80, 1, 2048, 32, 132, num_splits=1) == (1, 2048)
    assert wave_filling_splits(1, 1, 64, 32, 132, num_splits=1) == (1, 64)
    assert wave_filling_splits(1, 1, 32, 32, 132) == (1, 32)  # one tile: nothing to split
