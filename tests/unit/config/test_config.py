"""Config loading, overrides and validation: bad values are refused with the field named."""
import typing

import pytest

from lmforge.cli import build_parser
from lmforge.config import ConfigError, JobConfig, config_keys, load_config, read_yaml_file
from lmforge.config.keys import key
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
    (["train.seed=-1"], "train.seed"),
    ([f"train.seed={2**63}"], "train.seed"),
    (["train.eval_batches=0"], "train.eval_batches"),
    (["train.sample_tokens=-1"], "train.sample_tokens"),
    (["model.rope_theta=0"], "model.rope_theta"),
    (["model.norm_eps=-1e-5"], "model.norm_eps"),
    (["parallel.dp_shard=0"], "parallel.dp_shard"),
    (["parallel.dp_shard=-2"], "parallel.dp_shard"),
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


@pytest.mark.parametrize("override", [
    "model.rope_theta=inf", "model.norm_eps=nan", "lora.alpha=inf", "lora.dropout=nan",
    "data.eval_fraction=nan"])
def test_every_float_of_every_section_must_be_finite(override):
    field, value = override.split("=")
    with pytest.raises(ConfigError, match=rf"^{field}: {value} is not a finite number$"):
        validate_job(load_config(None, [override]))


def test_every_number_in_the_config_has_a_range_checked_before_any_compute():
    # A field with no range fails late, or with a message naming no field (train.seed=-1
    # failed in numpy after the model was built). data.global_batch_size: _validate_batch.
    checked_apart = {"data.global_batch_size"}
    unchecked = []
    cfg = JobConfig()
    for dotted, f, _ in config_keys(cfg):
        hint = typing.get_type_hints(type(getattr(cfg, dotted.split(".")[0])))[f.name]
        numeric = {int, float} & set(typing.get_args(hint) or [hint])
        meta = f.metadata
        if numeric and not (meta["bound"] or meta["choices"]) and dotted not in checked_apart:
            unchecked.append(dotted)
    assert unchecked == []


def test_every_key_declares_its_help_beside_it_and_train_help_lists_them_all(capsys):
    helpless = [dotted for dotted, f, _ in config_keys(JobConfig()) if not f.metadata["help"]]
    assert helpless == []
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    out = capsys.readouterr().out
    for dotted, f, value in config_keys(JobConfig()):
        assert f"  {dotted} (default {value!r}" in out, dotted
    assert "  train.dtype (default 'auto'; one of auto, fp32, bf16, fp16)" in out
    assert "  parallel.dp_shard (default -1; -1 (the rest of the world size) or >= 1)" in out


def test_a_key_whose_bound_has_no_rule_is_a_schema_error():
    with pytest.raises(ValueError, match="unknown bound"):
        key(1, "a key", bound="> 1")


def test_optim_eps_must_be_positive():
    with pytest.raises(ConfigError, match=r"^optim.eps: must be > 0"):
        validate_job(load_config(None, ["optim.eps=0"]))


def test_a_python_tag_in_a_yaml_file_is_refused_naming_the_file_and_line(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text('train:\n  seed: 1\noptim: !!python/object/apply:os.system ["touch F"]\n')
    with pytest.raises(ConfigError, match=rf"^{path}:3: the YAML tag "
                                          r"!!python/object/apply:os.system is refused"):
        read_yaml_file(path)
    path.write_text("a: !custom x\n")
    with pytest.raises(ConfigError, match=rf"^{path}:1: the YAML tag !custom is refused"):
        load_config(path)
    path.write_text("a: !!binary xx\n")  # a known tag with a bad value (not base64)
    with pytest.raises(ConfigError, match=rf"^{path}:1: not valid YAML \(failed to decode"):
        read_yaml_file(path)
    assert not (tmp_path / "F").exists()


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  seed: 1\n  max_steps: 2\n optim: x\n")
    with pytest.raises(ConfigError, match=rf"^{path}:4: not valid YAML"):
        load_config(path)
    path.write_bytes(b"train:\n  output_dir: \xff\n")
    with pytest.raises(ConfigError, match=rf"^{path}: not UTF-8 text"):
        read_yaml_file(path)


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
