"""`--config FILE`: YAML values under explicit flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.cli import _config_file_argv, parse_args
from pdserve.errors import ConfigError


def parse_serve(tmp_path: Path, yaml_text: str, *flags: str) -> object:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(yaml_text)
    return parse_args(["serve", "--config", str(cfg), *flags])


def test_file_values_apply_and_flags_override(tmp_path: Path) -> None:
    args = parse_serve(
        tmp_path, "max_num_seqs: 8\nport: 9001\nno-prefix-caching: true\n", "--port", "9002"
    )
    assert args.max_num_seqs == 8  # type: ignore[attr-defined]
    assert args.port == 9002  # type: ignore[attr-defined]
    assert args.no_prefix_caching is True  # type: ignore[attr-defined]


def test_unknown_key_fails_loudly(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):  # argparse: unrecognized arguments
        parse_serve(tmp_path, "max_num_sequences: 8\n")


def test_bad_type_fails_loudly(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):  # argparse: invalid int value
        parse_serve(tmp_path, "port: eighty\n")


def test_unreadable_or_non_mapping_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        _config_file_argv(str(tmp_path / "missing.yaml"))
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must map"):
        _config_file_argv(str(tmp_path / "list.yaml"))
