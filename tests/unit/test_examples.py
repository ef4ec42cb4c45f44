import pathlib

from streamrl.engine.config import build, load
from streamrl.ops.run import DEMO

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def test_every_example_config_loads():
    for path in sorted(EXAMPLES.glob("*.toml")):
        load(path)


def test_demo_toml_is_what_streamrl_run_does_by_default():
    written = load(EXAMPLES / "demo.toml")
    builtin = build({}, DEMO + ["run.device='cpu'"])
    assert written == builtin
