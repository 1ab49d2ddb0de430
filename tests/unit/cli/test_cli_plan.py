"""``lmforge plan`` on the command line: the ranked table, a winner `lmforge train` loads,
and one-line exit-2 errors naming what to change; ``lmforge estimate``'s fixes."""
from lmforge.cli import main
from lmforge.config import load_config
from lmforge.models.presets import validate_job

SMALL = ["model.preset=small", "model.vocab_size=32000", "data.seq_len=512",
         "data.global_batch_size=8"]


def test_plan_prints_a_ranked_table_and_writes_a_winner_the_trainer_accepts(tmp_path,
                                                                            capsys):
    out = tmp_path / "plan.yaml"
    assert main(["plan", *SMALL, "--gpus", "2", "--device", "a100-40g", "--top", "3",
                 "--output", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "legal layouts fit a100-40g" in lines[0] and "tok/s/dev" in lines[1]
    steps = [float(line.split()[-5]) for line in lines[2:5]]
    assert steps == sorted(steps)
    cfg = load_config(out)
    validate_job(cfg, world_size=2)
    p = cfg.parallel
    assert p.dp_replicate * p.dp_shard * p.tp * p.pp == 2 and cfg.data.global_batch_size == 8
    assert cfg.model.preset == "small"


def test_plan_refuses_gpus_not_a_multiple_of_the_node(capsys):
    assert main(["plan", *SMALL, "--gpus", "12", "--gpus-per-node", "8"]) == 2
    assert "--gpus: 12 is not a multiple of --gpus-per-node 8" in capsys.readouterr().err


def test_plan_names_the_known_devices_for_an_unknown_one(capsys):
    assert main(["plan", *SMALL, "--gpus", "1", "--device", "tpu"]) == 2
    err = capsys.readouterr().err
    assert "--device: unknown device 'tpu'" in err and "h100" in err and "a100-80g" in err


def test_plan_says_how_many_gpus_or_qlora_when_nothing_fits(capsys):
    assert main(["plan", "model.preset=llama2-13b", "model.vocab_size=32000",
                 "data.seq_len=512", "--gpus", "1", "--device", "a100-40g"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no layout fits 1 x a100-40g" in err
    assert "--gpus >= " in err and "lora.quantize=nf4" in err


def test_estimate_that_does_not_fit_exits_1_naming_changes_that_fit(capsys):
    code = main(["estimate", *SMALL[:3], "data.micro_batch_size=16", "train.device=cuda",
                 "--device-memory-gib", "4"])
    err = capsys.readouterr().err
    assert code == 1 and "does not fit 4 GiB" in err
    assert "train.activation_checkpointing=full" in err or "data.micro_batch_size=" in err
