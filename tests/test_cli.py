"""The command line fails fast and clearly on bad input (before any model is loaded)."""

import pytest

from wushkv.cli import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["ppl", "--transform", "hadamard", "--k-bits", "9"], "k_bits=9 is not supported"),
        (["ppl", "--transform", "hadamard", "--v-bits", "0"], "v_bits=0 is not supported"),
        (["ppl", "--transform", "foo"], "unknown transform 'foo'"),
        (["ppl", "--transform", "hadamard", "--quantizer", "nf4"], "unknown quantizer 'nf4'"),
        (["ppl", "--text-file", "/nonexistent/x.txt"], "does not exist"),
        (["compare", "--transforms", "identity,bogus"], "unknown transform 'bogus'"),
        (["compare", "--bits", "2,5"], "k_bits=5 is not supported"),
        (["recon", "--calibration", "x.safetensors", "--transforms", "nope"], "unknown transform 'nope'"),
        (["recon", "--calibration", "x.safetensors", "--transforms", "wush+tiles"], "unknown transform 'wush+tiles'"),
        (["compare", "--transforms", "wush+tile"], "optionally with the suffix '+tiles'"),
    ],
)
def test_bad_arguments(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_bits_parsing_error(capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--bits", "two"])
    assert "comma-separated bit widths" in capsys.readouterr().err
