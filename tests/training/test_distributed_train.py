"""Data-parallel training on two CPU processes (gloo) equals one process with the global batch."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from triclip.model.model import ModelConfig, build_model
from triclip.training.train import TrainConfig, train


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, cfg: TrainConfig, cache: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    os.environ["TRICLIP_CACHE"] = cache
    torch.set_num_threads(1)
    try:
        train(cfg)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("loss", ["tricl", "infonce"])
def test_two_gloo_ranks_match_one_process_on_the_global_batch(shapes_data, tmp_path, loss):
    common = dict(
        train_data=str(shapes_data / "train.jsonl"),
        model="tiny",
        embed_dim=16,
        loss=loss,
        loss_options={"tau_plus": 0.1} if loss == "tricl" else {},
        epochs=1,
        max_steps=3,
        lr=1e-3,
        warmup_steps=1,
    )
    torch.set_num_threads(1)
    single = tmp_path / "single"
    train(TrainConfig(out=str(single), batch_size=32, **common))

    double = tmp_path / "double"
    cfg = TrainConfig(out=str(double), batch_size=16, **common)  # per rank: 2 x 16 = 32
    mp.spawn(_rank_main, args=(2, _free_port(), cfg, str(tmp_path / "cache")), nprocs=2, join=True)

    a, b = load_file(str(single / "model.safetensors")), load_file(str(double / "model.safetensors"))
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5, msg=key)
    torch.manual_seed(0)
    init = build_model(ModelConfig(preset="tiny", embed_dim=16)).state_dict()
    assert not torch.allclose(a["image_head.weight"], init["image_head.weight"])  # it did train
