"""What a fresh install meets, named (issue 45 item 5): TE's empty meta package (``pip install transformer-engine``
without ``[pytorch]``), and torchao beside TE with no FP8 backend chosen (accelerate then picks torchao)."""

from __future__ import annotations

import pytest

from accel_fp8_fix import settings
from accel_fp8_fix.engine.versions import installed_versions
from accel_fp8_fix.internals import transformer_engine as te_internals

VERSIONS = installed_versions(("transformer-engine",))


@pytest.mark.skipif(VERSIONS.get("transformer-engine") is None, reason="transformer-engine not installed")
def test_te_meta_package_without_its_torch_extension_is_named_with_the_install_that_fixes_it(monkeypatch, capsys):
    """This venv has exactly that install (TE's Python, no transformer_engine_torch: the rehearsal's shim stands in):
    outside the rehearsal it is named, with the command; under the rehearsal, and with the extension, it is not."""
    from importlib import metadata

    monkeypatch.delenv(settings.REHEARSAL, raising=False)
    message = te_internals.meta_package_only(VERSIONS)
    te = VERSIONS["transformer-engine"]
    assert message.startswith(f"transformer-engine {te} is TE's meta package without its PyTorch extension")
    assert f'pip install "transformer-engine[pytorch]=={te}"' in message
    from accel_fp8_fix import cli

    cli.main(["doctor"])
    assert f"TE install  : {message}" in capsys.readouterr().out
    monkeypatch.setenv(settings.REHEARSAL, "1")
    assert te_internals.meta_package_only(VERSIONS) is None
    monkeypatch.delenv(settings.REHEARSAL)
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "2.20.2" if name == "transformer_engine_torch" else real(name))
    assert te_internals.meta_package_only(VERSIONS) is None
