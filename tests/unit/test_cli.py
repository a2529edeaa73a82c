"""The command line's usage errors (overlay/cli.py, CPU): an unknown flag is named, with the usage of the command it
was given to and the closest flag that command has; a missing or misspelt command says so; nothing is written."""

from __future__ import annotations

import pytest

from hybrid_exl3_fixes.cli import main


def usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    "argv, usage, said",
    [
        (["--frobnicate"], "usage: hybrid-exl3-fixes [-h]", "unrecognized arguments: --frobnicate"),
        (["--frobnicate", "status"], "usage: hybrid-exl3-fixes status", "unrecognized arguments: --frobnicate"),
        (["status", "--jsno"], "usage: hybrid-exl3-fixes status", "--jsno (did you mean --json?)"),
        (["doctor", "DIR", "--frobnicate"], "usage: hybrid-exl3-fixes doctor", "unrecognized arguments: --frobnicate"),
        (["doctor", "DIR", "--max-model-length", "4096"], "hybrid-exl3-fixes doctor", "did you mean --max-model-len?"),
        (["make-tiny", "DIR", "--bitz", "3"], "usage: hybrid-exl3-fixes make-tiny", "--bitz 3 (did you mean --bits?)"),
        (["stubs", "--outdir=x"], "usage: hybrid-exl3-fixes stubs", "--outdir=x (did you mean --out?)"),
        ([], "usage: hybrid-exl3-fixes [-h]", "a command is required: status, make-tiny, stubs or doctor"),
        (["stauts"], "usage: hybrid-exl3-fixes [-h]", "invalid choice: 'stauts'"),
        (["stubs", "--out"], "usage: hybrid-exl3-fixes stubs", "argument --out: expected one argument"),
    ],
)
def test_a_usage_error_names_what_was_wrong_with_that_command_s_usage(tmp_path, capsys, argv, usage, said):
    argv = [str(tmp_path / "new") if a == "DIR" else a for a in argv]
    err = usage_error(argv, capsys)
    assert usage in err and said in err, err
    assert "the following arguments are required: command" not in err
    assert list(tmp_path.iterdir()) == []  # nothing written
