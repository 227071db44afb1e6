"""Plugin discovery, selection, errors and configs."""

from __future__ import annotations

import json
import sys
import types
from importlib.machinery import ModuleSpec
from importlib.metadata import EntryPoint

import pytest

from genlm_core import (
    BackendNotFoundError,
    ModelConfig,
    OptionsError,
    PluginConflictError,
    PluginError,
    default_backend,
    get_plugins,
    hookimpl,
    load_model,
    load_model_by_name,
)
from genlm_core.mock import MockAsyncLM, MockOptions
from genlm_core.plugins import Plugins, reset_plugins
from genlm_core.testing import registered

from .helpers import BigramLM, ThirdPartyPlugin


class FakeDist:
    def __init__(self, name):
        self.name = name


class FakeEntryPoint:
    """Mirrors importlib.metadata.EntryPoint: name, group, dist and load()."""

    def __init__(self, name, value, dist):
        self.name, self.group, self.dist = name, "genlm", FakeDist(dist)
        self._ep = EntryPoint(name, value, "genlm")

    def load(self):
        return self._ep.load()


def fake_module(name, **attrs):
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


@pytest.fixture
def fake_distributions(monkeypatch, toy_tok):
    """Installs three fake distributions: a working one, one whose import fails, one whose hook raises."""
    plugin = ThirdPartyPlugin(toy_tok, name="fakebackend")

    def good_hook(register):
        plugin.register_backends(register)

    def boom_hook(register):
        raise RuntimeError("hook exploded")

    good = fake_module("fake_genlm_good", register_backends=hookimpl(good_hook))
    bad_hook = fake_module("fake_genlm_badhook", register_backends=hookimpl(boom_hook))
    monkeypatch.setitem(sys.modules, "fake_genlm_good", good)
    monkeypatch.setitem(sys.modules, "fake_genlm_badhook", bad_hook)
    eps = [
        FakeEntryPoint("good", "fake_genlm_good", "genlm-good"),
        FakeEntryPoint("broken", "fake_genlm_does_not_exist", "genlm-broken"),
        FakeEntryPoint("badhook", "fake_genlm_badhook", "genlm-badhook"),
    ]

    def entry_points(group=None):
        assert group == "genlm"
        return eps

    monkeypatch.setattr("importlib.metadata.entry_points", entry_points)
    monkeypatch.delenv("GENLM_PLUGINS", raising=False)
    yield reset_plugins()
    reset_plugins()


def test_discovery_through_entry_points(fake_distributions):
    plugins = fake_distributions
    backends = plugins.backends()
    assert "fakebackend" in backends and backends["fakebackend"].distribution == "genlm-good"
    failures = {f.plugin: f for f in plugins.failures}
    assert set(failures) == {"broken", "badhook"}
    assert failures["broken"].distribution == "genlm-broken" and "ModuleNotFoundError" in failures["broken"].error
    assert "hook exploded" in failures["badhook"].error
    # built-ins go through the same hooks
    assert {"numba", "torch"} <= set(plugins.trie_engines())
    assert plugins.trie_engines()["numba"].distribution == "genlm-core"


def test_broken_plugin_does_not_break_loading_others(fake_distributions):
    lm = load_model_by_name("anything", backend="fakebackend", llm_opts={"peak": 2.0})
    assert isinstance(lm, BigramLM) and lm.peak == 2.0


@pytest.mark.parametrize(
    ("env", "expected"),
    [("", set()), ("good", {"fakebackend"}), ("genlm-good,broken", {"fakebackend"}), (None, {"fakebackend"})],
)
def test_genlm_plugins_env_selects(fake_distributions, monkeypatch, env, expected):
    if env is not None:
        monkeypatch.setenv("GENLM_PLUGINS", env)
    plugins = reset_plugins()
    assert set(plugins.backends()) == expected | {"mock"}  # the built-in mock is always there
    assert {"numba", "torch"} <= set(plugins.trie_engines())  # and so are the built-in trie engines


def test_third_party_plugin_registered_per_test(fresh_plugins, toy_tok):
    plugin = ThirdPartyPlugin(toy_tok)
    with registered(plugin):
        lm = load_model_by_name("m", backend="bigram", llm_opts={"peak": 3.0, "batch_size": 4})
        assert lm.peak == 3.0 and lm.batcher.batch_size == 4
    with pytest.raises(BackendNotFoundError):
        get_plugins().backend("bigram")


def test_unknown_backend_lists_installed_and_pip_command(fresh_plugins, monkeypatch, toy_tok):
    monkeypatch.setenv("GENLM_PLUGINS", "")  # no installed plugin: only built-ins and the test's own
    reset_plugins()
    with registered(ThirdPartyPlugin(toy_tok)):
        with pytest.raises(
            BackendNotFoundError, match=r"'vllm' is not installed; available: \[.*bigram.*\].*pip install genlm-vllm"
        ):
            load_model_by_name("m", backend="vllm")
        with pytest.raises(BackendNotFoundError, match=r"pip install genlm-nosuch` \(genlm plugins are named"):
            load_model_by_name("m", backend="nosuch")
        with pytest.raises(BackendNotFoundError, match=r"pip install genlm-my-engine`"):
            load_model_by_name("m", backend="My_Engine")  # the distribution name, normalised as pip does


def test_misspelled_and_mistyped_options_name_option_and_backend(fresh_plugins, toy_tok):
    with registered(ThirdPartyPlugin(toy_tok)):
        with pytest.raises(OptionsError, match=r"backend 'bigram'.*unknown option 'paek'.*known: .*peak"):
            load_model_by_name("m", backend="bigram", llm_opts={"paek": 1.0})
        with pytest.raises(OptionsError, match=r"backend 'bigram'.*option 'batch_size'"):
            load_model_by_name("m", backend="bigram", llm_opts={"batch_size": "lots"})


def test_duplicate_names_name_both_plugins(fresh_plugins, toy_tok):
    with registered(ThirdPartyPlugin(toy_tok), "first-plugin"), registered(ThirdPartyPlugin(toy_tok), "second-plugin"):
        with pytest.raises(PluginConflictError, match="'first-plugin' and 'second-plugin'"):
            load_model_by_name("m", backend="bigram")


class Ranked:
    """A fake backend plugin that declares its default priority (and, optionally, a check); it loads
    the mock and records that it was the one loaded."""

    def __init__(self, name, priority, check=None):
        self.name, self.priority, self.check = name, priority, check
        self.loaded = []

    @hookimpl
    def register_backends(self, register):
        register.backend(self.name, self.load, options=MockOptions, default_priority=self.priority, check=self.check)

    def load(self, model, options):
        self.loaded.append(model)
        return MockAsyncLM.from_options(model, options)


@pytest.fixture
def only_fakes(fresh_plugins, monkeypatch):
    """No installed plugin: only the built-in mock and what the test registers."""
    monkeypatch.setenv("GENLM_PLUGINS", "")
    return reset_plugins()


def test_default_backend_is_the_highest_priority_that_can_run(only_fakes):
    gpu = {"on": False}
    low, on_gpu = Ranked("low", 5), Ranked("gpu", lambda: 20 if gpu["on"] else 0)
    with registered(low), registered(on_gpu):
        assert default_backend() == "low"  # 5 beats the gpu backend's 0 without a GPU
        gpu["on"] = True
        assert default_backend() == "gpu"  # the condition is evaluated when a default is asked for
        with registered(Ranked("top", 30, check=lambda: "needs a TPU")):
            assert default_backend() == "gpu"  # the best cannot run here: the next one is picked
            load_model_by_name("gpt2").cleanup()  # and load_model_by_name uses it
        assert on_gpu.loaded == ["gpt2"] and low.loaded == []


def test_default_backend_ties_and_no_candidate_are_errors_naming_them(only_fakes):
    with pytest.raises(BackendNotFoundError, match=r"installed are \[mock\], and mock is never picked by default"):
        default_backend()  # the model-free mock declares None
    with registered(Ranked("b", 0)), registered(Ranked("a", 0)):
        with pytest.raises(BackendNotFoundError, match=r"'a' and 'b' rank equally \(default priority 0\)"):
            default_backend()
        with registered(Ranked("c", 1, check=lambda: "no engine")):  # cannot run: the tie below stands
            with pytest.raises(BackendNotFoundError, match="'a' and 'b' rank equally"):
                default_backend()
    with registered(Ranked("broken", 9, check=lambda: "no engine")):
        with pytest.raises(BackendNotFoundError, match=r"\[broken \(cannot run here: no engine\), mock\]"):
            default_backend()


def test_a_priority_can_be_lazy_and_a_failing_one_counts_as_zero(only_fakes, monkeypatch):
    probe = fake_module("fake_genlm_probe", ten=lambda: 10, boom=lambda: 1 / 0, text=lambda: "high")
    probe.__spec__ = ModuleSpec("fake_genlm_probe", None)  # findable, as an installed module is
    monkeypatch.setitem(sys.modules, "fake_genlm_probe", probe)
    with registered(Ranked("lazy", "fake_genlm_probe:ten")), registered(Ranked("zero", 0)):
        assert default_backend() == "lazy"
    with registered(Ranked("boom", "fake_genlm_probe:boom")), registered(Ranked("one", 1)):
        assert default_backend() == "one"
        assert get_plugins().backend("boom").priority_here() == 0
    with registered(Ranked("text", "fake_genlm_probe:text")):
        assert get_plugins().backend("text").priority_here() == 0  # not an int: counted as 0


@pytest.mark.parametrize("priority", [True, 1.5, "no colon", "genlm_no_such_module:f"])
def test_a_bad_priority_is_a_failure_of_its_plugin(only_fakes, priority):
    with registered(Ranked("bad", priority), "bad-plugin"):
        assert "bad" not in get_plugins().backends()
        (failure,) = get_plugins().failures
        assert failure.plugin == "bad-plugin" and "default_priority" in failure.error


def test_a_declared_install_command_is_the_repair_hint(only_fakes):
    class Missing:
        @hookimpl
        def register_backends(self, register):
            register.backend("missing", "genlm_core.mock:NoSuchClass", install="pip install 'genlm-missing[gpu]'")

    with registered(Missing()):
        with pytest.raises(PluginError, match=r"install what it needs: pip install 'genlm-missing\[gpu\]'$"):
            load_model_by_name("gpt2", backend="missing")


def today_rule(installed, cuda):
    """The selection rule core hard-coded before backends declared priorities: the reference."""
    if "vllm" in installed and cuda:
        return "vllm"
    if "hf" in installed:
        return "hf"
    models = sorted(set(installed) - {"mock"})
    return models[0] if len(models) == 1 else None


REAL_PLUGINS = ["hf", "vllm", "mlx", "llamacpp", "example"]


def test_the_real_plugins_declarations_keep_the_selection_order(fresh_plugins, monkeypatch):
    import itertools

    import torch

    installed = reset_plugins().backends()
    present = [name for name in REAL_PLUGINS if name in installed and installed[name].unavailable_reason() is None]
    if not {"hf", "vllm"} <= set(present):
        pytest.skip("needs genlm-hf and genlm-vllm installed and runnable")
    checked = 0
    for cuda in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        for size in range(len(present) + 1):
            for subset in itertools.combinations(present, size):
                monkeypatch.setenv("GENLM_PLUGINS", ",".join(subset))
                reset_plugins()
                expected = today_rule([*subset, "mock"], cuda)
                if expected is None:
                    with pytest.raises(BackendNotFoundError, match="no default backend"):
                        default_backend()
                else:
                    assert default_backend() == expected, (subset, cuda)
                checked += 1
    assert checked == 2 ** (len(present) + 1)


def test_load_model_from_config_dict_and_files(fresh_plugins, toy_tok, tmp_path):
    with registered(ThirdPartyPlugin(toy_tok)):
        cfg = {"backend": "bigram", "model": "m", "options": {"peak": 1.5}}
        assert load_model(cfg).peak == 1.5
        assert load_model(ModelConfig(**cfg)).peak == 1.5
        (tmp_path / "m.json").write_text(json.dumps(cfg))
        assert load_model(tmp_path / "m.json").peak == 1.5
        (tmp_path / "m.toml").write_text('backend = "bigram"\nmodel = "m"\n[options]\npeak = 2.5\n')
        assert load_model(str(tmp_path / "m.toml")).peak == 2.5
        with pytest.raises(ValueError, match="modle"):
            load_model({"backend": "bigram", "modle": "m"})
        with pytest.raises(ValueError, match=r"\.toml or \.json"):
            load_model(tmp_path / "m.yaml")


def test_factory_must_return_an_asynclm(fresh_plugins):
    class Wrong:
        @hookimpl
        def register_backends(self, register):
            register.backend("wrong", lambda model, options: object())

    with registered(Wrong()):
        with pytest.raises(TypeError, match="not an AsyncLM"):
            load_model_by_name("m", backend="wrong")


def test_lazy_factory_is_imported_only_on_use(fresh_plugins):
    class Lazy:
        @hookimpl
        def register_backends(self, register):
            register.backend("lazy", "genlm_core.testing:no_such_factory", check="genlm_core.testing:no_such_check")

    with registered(Lazy(), "lazy-plugin"):
        spec = get_plugins().backend("lazy")  # listing does not import it
        assert "AttributeError" in spec.unavailable_reason()
        with pytest.raises(PluginError, match=r"plugin 'lazy-plugin'.*'genlm_core.testing:no_such_factory'.*resolve"):
            load_model_by_name("m", backend="lazy")
        (failure,) = get_plugins().failures
        assert failure.plugin == "lazy-plugin" and "no_such_factory" in failure.error


def entry_point_plugins(monkeypatch, *specs):
    """A Plugins over fake entry points: each spec is (entry point name, distribution, module or None)."""
    eps = []
    for name, dist, module in specs:
        module_name = f"fake_genlm_{name}_{dist}".replace("-", "_")
        if module is not None:
            monkeypatch.setitem(sys.modules, module_name, module)
        eps.append(FakeEntryPoint(name, module_name, dist))
    monkeypatch.delenv("GENLM_PLUGINS", raising=False)
    return Plugins(entry_points=lambda group=None: eps)


def backend_module(name, toy_tok, **extra):
    plugin = ThirdPartyPlugin(toy_tok, name=name)
    return fake_module(
        f"m_{name}", register_backends=hookimpl(lambda register: plugin.register_backends(register)), **extra
    )


def test_name_collision_names_both_distributions_and_the_rest_still_load(monkeypatch, toy_tok):
    plugins = entry_point_plugins(
        monkeypatch,
        ("dup", "genlm-first", backend_module("first", toy_tok)),
        ("dup", "genlm-second", backend_module("second", toy_tok)),
        ("third", "genlm-third", backend_module("third", toy_tok)),
    )
    assert set(plugins.backends()) - {"mock"} == {"first", "third"}
    (failure,) = plugins.failures
    assert failure.distribution == "genlm-second"
    assert "name collision" in failure.error and "genlm-first" in failure.error and "genlm-second" in failure.error
    assert plugins.failures == [failure]  # asked again: the same answer, no partial registry


def test_misspelled_hook_is_a_failure_not_silence(monkeypatch, toy_tok):
    typo = fake_module("typo", register_backend=hookimpl(lambda register: None))
    plugins = entry_point_plugins(
        monkeypatch, ("typo", "genlm-typo", typo), ("good", "genlm-good", backend_module("good", toy_tok))
    )
    assert set(plugins.backends()) - {"mock"} == {"good"}
    (failure,) = plugins.failures
    assert failure.distribution == "genlm-typo"
    assert "'register_backend' (did you mean 'register_backends'?) matches no genlm hook" in failure.error


def test_bad_hook_signature_is_a_failure(monkeypatch, toy_tok):
    wrong = fake_module("wrong", register_backends=hookimpl(lambda registry: None))
    plugins = entry_point_plugins(
        monkeypatch, ("wrong", "genlm-wrong", wrong), ("good", "genlm-good", backend_module("good", toy_tok))
    )
    assert set(plugins.backends()) - {"mock"} == {"good"}
    (failure,) = plugins.failures
    assert failure.distribution == "genlm-wrong" and "invalid hook" in failure.error and "registry" in failure.error


def test_factory_string_that_cannot_resolve_is_a_failure_and_other_backends_register(monkeypatch):
    def hook(register):
        register.backend("missing", "genlm_no_such_package.model:load")
        register.backend("malformed", "no colon here")
        register.backend("fine", "genlm_core.testing:check_lm_contract")
        register.backend("unresolvable", "genlm_core.testing:check_lm_contract", resolve_name="genlm_nowhere:find")

    plugins = entry_point_plugins(
        monkeypatch, ("multi", "genlm-multi", fake_module("multi", register_backends=hookimpl(hook)))
    )
    assert set(plugins.backends()) - {"mock"} == {"fine"}
    errors = sorted(f.error for f in plugins.failures)
    assert all(f.distribution == "genlm-multi" for f in plugins.failures)
    assert "'malformed': factory 'no colon here' must look like 'package.module:attr'" in errors[0]
    assert "no module named 'genlm_no_such_package'" in errors[1]
    assert "'unresolvable': resolve_name 'genlm_nowhere:find' does not resolve" in errors[2]


def test_import_failure_is_recorded_and_discovery_can_be_retried(monkeypatch, toy_tok):
    plugins = entry_point_plugins(monkeypatch, ("late", "genlm-late", None))  # module not importable yet
    assert "late" not in plugins.backends()
    (failure,) = plugins.failures
    assert "import failed: ModuleNotFoundError" in failure.error
    with pytest.raises(BackendNotFoundError, match=r"its plugin failed: late \(genlm-late\): import failed"):
        plugins.backend("late")
    monkeypatch.setitem(sys.modules, "fake_genlm_late_genlm_late", backend_module("late", toy_tok))
    plugins.discover(retry=True)
    assert "late" in plugins.backends() and plugins.failures == []


def test_listing_entry_points_failing_is_recorded(monkeypatch):
    def broken(group=None):
        raise OSError("metadata unreadable")

    plugins = Plugins(entry_points=broken)
    assert {"numba", "torch"} <= set(plugins.trie_engines())  # built-ins still there
    assert "metadata unreadable" in plugins.failures[0].error


def test_explicit_registration_refuses_broken_plugins(fresh_plugins):
    typo = fake_module("typo", register_backend=hookimpl(lambda register: None))
    with pytest.raises(PluginError, match="did you mean 'register_backends'"):
        fresh_plugins.register(typo, "typo")
    assert fresh_plugins.manager.get_plugin("typo") is None


def test_installed_mock_plugin_is_discovered():
    plugins = Plugins()
    spec = plugins.backend("mock")
    assert spec.distribution == "genlm-core" and spec.unavailable_reason() is None


def test_dotted_keys_in_llm_opts_set_a_nested_option_s_fields(fresh_plugins, toy_tok):
    from pydantic import Field

    from genlm_core.live import LiveOptions
    from genlm_core.mock import MockAsyncLM, MockOptions

    class Options(MockOptions):
        live: LiveOptions = Field(default_factory=lambda: LiveOptions.model_validate({}), description="Live.")

    class Plugin:
        @hookimpl
        def register_backends(self, register):
            register.backend("nested", lambda name, options: MockAsyncLM(toy_tok, options), options=Options)

    with registered(Plugin()):
        lm = load_model_by_name("m", backend="nested", llm_opts={"live.lookback": 3, "live": {"enabled": False}})
        assert (lm.options.live.lookback, lm.options.live.enabled) == (3, False)
        assert Options(**{"live.max_sequences": 5}).live.max_sequences == 5  # the model itself takes them too
        with pytest.raises(
            OptionsError, match=r"^invalid options for backend 'nested': option 'live.lookback': .* \(got 0\)$"
        ):
            load_model_by_name("m", backend="nested", llm_opts={"live": {"lookback": 0}})
