"""Config loading, overrides and validation: bad values are refused with the field named."""
import pytest

from lmforge.config import ConfigError, JobConfig, load_config
from lmforge.models.presets import model_args, validate_job


def test_defaults_are_the_cpu_demo_and_validate():
    cfg = load_config(None)
    assert cfg.data.kind == "stdlib" and cfg.model.preset == "tiny"
    cfg.validate()


def test_overrides_are_typed():
    cfg = load_config(None, ["optim.lr=3e-4", "train.max_steps=50", "train.compile=true",
                             "model.n_layers=2", "data.path=[a, b]"])
    assert cfg.optim.lr == pytest.approx(3e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.train.max_steps == 50 and cfg.train.compile is True
    assert cfg.model.n_layers == 2 and cfg.data.path == ["a", "b"]


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 1.0e-3\ntrain:\n  max_steps: 7\n")
    cfg = load_config(path, ["train.max_steps=9"])
    assert cfg.optim.lr == 1e-3 and cfg.train.max_steps == 9


@pytest.mark.parametrize("override, field", [
    ("optim.lrr=1", "optim.lrr"),
    ("nosection.x=1", "nosection"),
    ("train.max_steps=abc", "train.max_steps"),
    ("train.compile=maybe", "train.compile"),
    ("optim.lr", "optim.lr"),
])
def test_bad_override_names_the_field(override, field):
    with pytest.raises(ConfigError, match=rf"^{field}"):
        load_config(None, [override])


@pytest.mark.parametrize("overrides, field", [
    (["optim.lr=-1"], "optim.lr"),
    (["optim.lr=0"], "optim.lr"),
    (["model.n_heads=8", "model.n_kv_heads=3"], "model.n_kv_heads"),
    (["model.dim=100", "model.n_heads=8"], "model.n_heads"),
    (["data.seq_len=4096"], "data.seq_len"),
    (["data.seq_len=0"], "data.seq_len"),
    (["model.preset=llama9"], "model.preset"),
    (["optim.schedule=exp"], "optim.schedule"),
    (["data.kind=text"], "data.path"),
    (["data.global_batch_size=12"], "data.global_batch_size"),
    (["parallel.tp=2"], "parallel.dp_shard"),
    (["train.max_steps=-5"], "train.max_steps"),
    (["model.init_from=/does/not/exist"], "model.init_from"),
    (["optim.beta2=1.5"], "optim.beta2"),
])
def test_validate_refuses_bad_values_naming_the_field(overrides, field):
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError, match=rf"^{field}"):
        validate_job(cfg)


@pytest.mark.parametrize("override", [
    "optim.lr=inf", "optim.lr=nan", "optim.min_lr_ratio=nan", "optim.weight_decay=inf",
    "optim.beta1=-inf", "optim.beta2=nan", "optim.eps=inf", "optim.grad_clip=inf"])
def test_every_optim_float_must_be_finite_and_the_message_names_the_field(override):
    field, value = override.split("=")
    cfg = load_config(None, [override])
    with pytest.raises(ConfigError, match=rf"^{field}: {value} is not a finite number$"):
        validate_job(cfg)


def test_optim_eps_must_be_positive():
    with pytest.raises(ConfigError, match=r"^optim.eps: must be > 0"):
        validate_job(load_config(None, ["optim.eps=0"]))


def test_bad_yaml_file_is_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("optim: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(path)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_model_fields_override_the_preset():
    cfg = load_config(None, ["model.preset=llama2-7b", "model.n_layers=2"])
    args = model_args(cfg)
    assert args.n_layers == 2 and args.dim == 4096 and args.vocab_size == 32000


def test_round_trip_through_dict():
    cfg = load_config(None, ["optim.lr=0.5"])
    again = JobConfig()
    from lmforge.config import apply_dict

    apply_dict(again, cfg.to_dict())
    assert again == cfg
