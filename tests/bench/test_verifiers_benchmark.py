"""benchmarks/verifiers.py: every method of its line-up parses, is exact, and gets the verifier its label promises
(a refused pairing would only show hours into the benchmark, as a skipped row); its pooled table renders."""
import pytest

from arborspec.runspec import build_decoder, parse
from tests.conftest import load_benchmark, noisy_copy, tiny_model


@pytest.fixture(scope="module")
def script():
    return load_benchmark("verifiers")


def test_every_method_runs_with_the_verifier_it_names(script):
    target = tiny_model("llama", seed=0)
    draft = noisy_copy(target, 0.5)
    verifiers = []
    for name in script.METHODS:
        dec = build_decoder(parse(name), target, draft, temperature=0.6)
        res = dec.generate([4, 9, 12], max_new_tokens=6, ignore_eos=True, seed=0)
        assert len(res.token_ids) == 6 and not res.stats.lossy
        verifiers.append(dec.verifier.name)
    assert verifiers == ["naive", "sps", "asps", "block", "naive", "mbr", "traversal", "mss", "traversal",
                         "greedy-draft"]


def test_the_command_and_the_pooled_table(script, capsys):
    assert script.main(["--print-only", "--prompts", "2"]) == 0
    command = capsys.readouterr().out
    assert "--backend native" in command and "--temperatures 0.6,1" in command and "--prompts 2" in command
    run = dict(dataset="humaneval", temperature=1.0, prompt_key="p0", error=None, committed_per_step=[3, 1],
               accepted_per_step=[2, 0], drafted_per_step=[4, 4], depth_per_step=[4, 4],
               root_optimum_per_step=[0.8, 0.6], tokens_per_s=5.0, wall=1.0, new_tokens=4, verifier="sps",
               lossy=False, label="sps@4")
    results = dict(command="arborspec bench ...", settings=dict(datasets=["humaneval"]), prompts=[{}], runs=[run])
    table = script.pooled_tables(results)
    assert "| sps@4 | sps | 2.00 | 0.50/0.50/0.00 | 50.0 | 0.50 / 0.70 | 5.00 | – |" in table


def test_paired_differences_compare_the_same_prompts(script):
    def run(label, key, mat, steps=4):
        return dict(temperature=1.0, label=label, prompt_key=key, error=None, committed_per_step=[mat] * steps)

    runs = [run("sps@4", "p0", 2.0), run("sps@4", "p1", 3.0), run("asps@4", "p0", 2.5), run("asps@4", "p1", 3.0),
            run("asps@4", "p2", 9.0)]  # p2 has no sps run: left out of the pair
    text = "\n".join(script.paired_differences({"runs": runs}))
    assert "| 1 | asps@4 | sps@4 | 2 | +0.250 ± 0.250 | 1.100 |" in text
