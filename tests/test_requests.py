"""The request API on CPU: add_request / step / abort, generate_async, partial rollouts, the TP driver.

Streaming semantics (cumulative outputs, finished once, abort frees blocks), errors that change nothing,
`generate` equal to the add_request + step loop and to 200 concurrent generate_async tasks (bitwise),
requests kept across a `ppo_step` with their policy versions, and one driver per TP group on 2 gloo ranks.
"""

import asyncio
import copy

import pytest
import torch
import torch.distributed as dist

import hybridengine as he
from _dist import reporting, spawn

GREEDY = he.SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread is faster, and far faster on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_engine(tp=1, **kw):
    cfg = dict(dtype=torch.float32, device="cpu", tp_generation=tp, block_size=4, max_model_len=64, max_num_seqs=8,
               max_num_batched_tokens=64)
    torch.manual_seed(0)
    return he.HybridEngine(he.model_config("tiny-qwen2"), he.EngineConfig(**(cfg | kw)))


def prompts_for(lens, seed=1, vocab=128):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def mixed_params():
    return [he.SamplingParams(temperature=1.0, max_tokens=9, seed=11),
            he.SamplingParams(n=3, temperature=0.9, top_k=30, max_tokens=7, seed=5),
            he.SamplingParams(temperature=0.0, max_tokens=5),
            he.SamplingParams(n=2, temperature=0.8, max_tokens=11, seed=3)]


def run_requests(engine, prompts, params, ids=None):
    """add_request every prompt, step until done: {id: the finished output}, each reported finished once."""
    ids = ids or [f"r{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params):
        engine.add_request(rid, prompt, p)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done
                done[out.request_id] = out
    return [done[rid] for rid in ids]


def completions(outs):
    return [[(c.token_ids, c.logprobs, c.finish_reason) for c in out.outputs] for out in outs]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_generate_equals_the_add_request_step_loop_bitwise(async_scheduling):
    """Greedy and seeded rows, n > 1, stop tokens, admissions from the queue (8 rows for 9 samples): the same
    tokens and log-probs, bit for bit, as `generate`, which runs the same schedule (each in its own rollout:
    the same prefix cache)."""
    engine = make_engine(tuning=he.EngineTuning(async_scheduling=async_scheduling))
    prompts = prompts_for([3, 9, 17, 6])
    params = mixed_params()
    with engine.rollout():
        stop = engine.generate(prompts, params)[0].outputs[0].token_ids[4]
    params[0].stop_token_ids = (stop,)
    with engine.rollout():
        expected = engine.generate(prompts, params)
    with engine.rollout():
        got = run_requests(engine, prompts, params)
        assert not engine.has_unfinished_requests() and engine.step() == []
    assert completions(got) == completions(expected)
    assert expected[0].outputs[0].finish_reason == "stop"
    assert [o.request_id for o in expected] == [None] * 4 and [o.request_id for o in got] == ["r0", "r1", "r2", "r3"]
    for out in got + expected:
        assert out.finished and all(c.policy_versions == [0] * len(c.token_ids) for c in out.outputs)


def test_step_streams_cumulative_outputs():
    """Each step reports the requests that progressed: a sample's tokens, log-probs and versions only grow,
    its finish reason is None until it finishes, `finished` comes once, after every sample finished."""
    engine = make_engine()
    prompts = prompts_for([5, 7])
    params = [he.SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=2), he.SamplingParams(max_tokens=3, seed=4)]
    seen = {"a": None, "b": None}
    with engine.rollout():
        engine.add_request("a", prompts[0], params[0])
        engine.add_request("b", prompts[1], params[1])
        reports = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                reports += 1
                last = seen[out.request_id]
                assert last is None or not last.finished, "reported after it finished"
                assert out.prompt_token_ids == prompts[out.request_id == "b"]
                for j, c in enumerate(out.outputs):
                    assert c.index == j and len(c.token_ids) == len(c.logprobs) == len(c.policy_versions)
                    if last is not None:
                        before = last.outputs[j]
                        assert c.token_ids[:len(before.token_ids)] == before.token_ids
                        assert c.logprobs[:len(before.logprobs)] == before.logprobs
                    assert (c.finish_reason is None) == (len(c.token_ids) < params[out.request_id == "b"].max_tokens)
                assert out.finished == all(c.finish_reason is not None for c in out.outputs)
                seen[out.request_id] = out
        assert reports > 4
    assert all(out.finished for out in seen.values())
    assert [len(c.token_ids) for c in seen["a"].outputs] == [6, 6] and len(seen["b"].outputs[0].token_ids) == 3


def test_delta_and_final_only_outputs_add_up_to_the_cumulative_one():
    """output_kind "delta": the reports' tokens, log-probs and versions concatenate to the cumulative run's
    final output, each token reported once, the finish reason with the last; "final_only": one report, the
    finished output. Same seeds, so the three runs sample the same tokens."""
    prompts = prompts_for([5, 7])

    def run(kind):
        engine = make_engine()
        params = [he.SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=2, output_kind=kind),
                  he.SamplingParams(max_tokens=3, seed=4, output_kind=kind)]
        reports = {"a": [], "b": []}
        with engine.rollout():
            engine.add_request("a", prompts[0], params[0])
            engine.add_request("b", prompts[1], params[1])
            while engine.has_unfinished_requests():
                for out in engine.step():
                    reports[out.request_id].append(out)
        return reports

    full, delta, final = run("cumulative"), run("delta"), run("final_only")
    for rid in ("a", "b"):
        expected = full[rid][-1]
        assert [out.finished for out in final[rid]] == [True]
        assert final[rid][0].outputs == expected.outputs
        assert [out.finished for out in delta[rid]] == [False] * (len(delta[rid]) - 1) + [True]
        for j, c in enumerate(expected.outputs):
            parts = [out.outputs[j] for out in delta[rid]]
            assert sum((p.token_ids for p in parts), []) == c.token_ids
            assert sum((p.logprobs for p in parts), []) == c.logprobs
            assert sum((p.policy_versions for p in parts), []) == c.policy_versions
            assert [p.finish_reason for p in parts if p.finish_reason is not None] == [c.finish_reason]
        assert len(delta[rid]) > 1


def greedy_reference(model, prompt, max_tokens, stop=()):
    """Greedy decoding by the transformers model in float64, one full forward per token: the token ids, up to
    max_tokens or through a stop token, which is kept (vLLM's convention)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] in stop:
                break
    return ids[len(prompt):]


def forced_logprobs(model, prompt, tokens, dtype):
    """The log-probs of `tokens` after `prompt` from one forward of the transformers model in `dtype`."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = copy.deepcopy(model).to(dtype)(ids).logits[0, len(prompt) - 1:-1].log_softmax(-1)
    return logp.gather(-1, ids[0, len(prompt):, None]).squeeze(1).double()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_finished_outputs_hold_the_last_token(async_scheduling):
    """A finished sample's output holds every token through the last one (the max_tokens-th, or the stop
    token), as greedy decoding by the transformers model in float64 gives them, through each way out:
    generate, generate_async, and add_request + step with cumulative, delta (concatenated) and final_only
    outputs; one log-prob per token, each within 4 x what transformers in float32 is off the float64 ones
    (+ 4 fp32 ulps of their scale)."""
    from test_training import build

    hf = build(initializer_range=0.2)  # at the default 0.02 greedy decoding repeats the prompt's last token
    engine = he.HybridEngine(hf, he.EngineConfig(dtype=torch.float32, device="cpu", block_size=4, max_model_len=64,
                                                 max_num_seqs=8,
                                                 tuning=he.EngineTuning(async_scheduling=async_scheduling)))
    prompts = prompts_for([3, 9])
    reference = copy.deepcopy(hf).double()
    length = greedy_reference(reference, prompts[0], 5)
    stop = length[2]
    assert stop not in length[:2]
    requests = [(prompts[0], 5, ()), (prompts[0], 5, (stop,)), (prompts[1], 1, ())]
    expected = [(length, "length"), (length[:3], "stop"), (greedy_reference(reference, prompts[1], 1), "length")]
    assert [len(tokens) for tokens, _ in expected] == [5, 3, 1]
    truth = [forced_logprobs(hf, p, tokens, torch.float64) for (p, _, _), (tokens, _) in zip(requests, expected)]
    same = [forced_logprobs(hf, p, tokens, torch.float32) for (p, _, _), (tokens, _) in zip(requests, expected)]
    tol = 4 * max((a - b).abs().max().item() for a, b in zip(same, truth)) + \
        4 * 2.0**-23 * max(t.abs().max().item() for t in truth)

    def params(kind="cumulative"):
        return [he.SamplingParams(temperature=0.0, max_tokens=m, stop_token_ids=s, output_kind=kind)
                for _, m, s in requests]

    runs = {}
    with engine.rollout():
        runs["generate"] = [out.outputs[0] for out in engine.generate([p for p, _, _ in requests], params())]
    for kind in ("cumulative", "delta", "final_only"):
        with engine.rollout():
            for i, ((prompt, _, _), p) in enumerate(zip(requests, params(kind))):
                engine.add_request(f"r{i}", prompt, p)
            parts = {f"r{i}": [] for i in range(len(requests))}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    parts[out.request_id].append(out)
        assert all(outs[-1].finished for outs in parts.values())
        if kind == "delta":
            runs[kind] = [he.CompletionOutput(0, sum((o.outputs[0].token_ids for o in outs), []),
                                              sum((o.outputs[0].logprobs for o in outs), []),
                                              outs[-1].outputs[0].finish_reason, [])
                          for outs in parts.values()]
        else:
            runs[kind] = [outs[-1].outputs[0] for outs in parts.values()]

    async def tasks():
        with engine.rollout():
            return await asyncio.gather(*(engine.generate_async(p, sp) for (p, _, _), sp in zip(requests, params())))

    runs["generate_async"] = [out.outputs[0] for out in asyncio.run(tasks())]
    for way, outputs in runs.items():
        for i, (c, (tokens, reason), logprobs) in enumerate(zip(outputs, expected, truth)):
            assert (c.token_ids, c.finish_reason) == (tokens, reason), (way, i)
            assert len(c.logprobs) == len(tokens), (way, i, c.logprobs)
            err = (torch.tensor(c.logprobs, dtype=torch.float64) - logprobs).abs().max().item()
            assert err <= tol, (way, i, err, tol)

def test_output_kind_is_checked():
    with pytest.raises(ValueError, match="output_kind must be one of"):
        he.SamplingParams(output_kind="DELTA")


def test_abort_frees_blocks_and_leaves_the_others_alone():
    """abort drops a running request (mid async step), a waiting one and one never stepped; their blocks
    are free at once; the others finish as they would without them; a finished id is a no-op."""
    engine = make_engine(max_num_seqs=4)
    prompts = prompts_for([9, 6, 11, 5])
    params = [he.SamplingParams(temperature=0.0, max_tokens=12)] * 4
    with engine.rollout():
        expected = engine.generate(prompts[:2], params[:2])
        blocks = engine._session.sched.blocks
        free = blocks.num_free
        engine.add_request("keep0", prompts[0], params[0])
        engine.add_request("gone", prompts[2], params[2])
        engine.add_request("keep1", prompts[1], params[1])
        engine.add_request("queued", prompts[3], he.SamplingParams(n=3, max_tokens=4))  # 3 + 3 > 4 rows: waits
        for _ in range(4):
            engine.step()
        assert engine._session.inflight is not None and blocks.num_free < free
        engine.abort("gone")
        engine.abort("queued")
        engine.add_request("late", prompts[3], params[3])
        engine.abort("late")
        engine.abort("late")  # aborted already: no-op
        done = {}
        while engine.has_unfinished_requests():
            done |= {o.request_id: o for o in engine.step() if o.finished}
        assert sorted(done) == ["keep0", "keep1"]
        assert blocks.num_free == free
        engine.abort("keep0")  # finished in this rollout: no-op
        with pytest.raises(ValueError, match="abort: unknown request_id 'nope'"):
            engine.abort("nope")
    for rid, exp in zip(["keep0", "keep1"], expected):
        assert done[rid].outputs[0].token_ids == exp.outputs[0].token_ids


def test_abort_reports_the_tokens_so_far():
    """An aborted generate_async request returns what it has, finish_reason 'abort'."""
    engine = make_engine()

    async def main():
        with engine.rollout():
            task = asyncio.create_task(engine.generate_async([1, 2, 3], he.SamplingParams(n=2, max_tokens=20, seed=1)))
            while not engine.has_unfinished_requests() or engine._session.num_steps < 4:
                await asyncio.sleep(0)
            engine.abort("async-0")
            return await task

    out = asyncio.run(main())
    assert out.finished and out.request_id == "async-0"
    assert all(c.finish_reason == "abort" and 2 <= len(c.token_ids) < 20 for c in out.outputs)
    assert all(len(c.logprobs) == len(c.token_ids) for c in out.outputs)


ADD = "add_request"


@pytest.mark.parametrize("call,args,match", [
    (ADD, (7, [1, 2], GREEDY), "request_id must be a str, got int 7"),
    (ADD, ("a", [1, 2], GREEDY), "request_id 'a' is already a live request"),
    (ADD, ("x", [], GREEDY), "prompt_token_ids is empty"),
    (ADD, ("x", [1, 500], GREEDY), r"prompt_token_ids has token id 500 outside the vocabulary \[0, 128\)"),
    (ADD, ("x", [1, 2.0], GREEDY), r"prompt_token_ids\[1\] must be an integer token id, got float 2.0"),
    (ADD, ("x", "hi", GREEDY), r"prompt_token_ids is text \('hi'\)"),
    (ADD, ("x", 5, GREEDY), "prompt_token_ids must be a list of token ids, got int 5"),
    (ADD, ("x", [1] * 60, GREEDY), r"prompt_token_ids: prompt length 60 \+ max_tokens 8 exceeds max_model_len=64"),
    (ADD, ("x", [1, 2], dict(max_tokens=2)), "sampling_params must be a SamplingParams, got dict"),
    (ADD, ("x", [1, 2], he.SamplingParams(n=9)), "sampling_params: n=9 samples exceed EngineConfig.max_num_seqs=8"),
    ("abort", ("zz",), "abort: unknown request_id 'zz'"),
    ("abort", (3,), "request_id must be a str, got int 3"),
])
def test_bad_calls_raise_and_change_nothing(call, args, match):
    engine = make_engine()
    prompt = prompts_for([6])[0]
    with engine.rollout():
        expected = engine.generate([prompt], GREEDY)[0].outputs[0]
    with engine.rollout():
        engine.add_request("a", prompt, GREEDY)
        engine.step()
        with pytest.raises(ValueError, match=match):
            getattr(engine, call)(*args)
        got = []  # "a" runs on, untouched
        while engine.has_unfinished_requests():
            got += [o for o in engine.step() if o.finished]
    assert completions(got) == [[(expected.token_ids, expected.logprobs, "length")]]


def test_calls_outside_rollout_raise():
    engine = make_engine()
    for call, args in [("step", ()), ("add_request", ("a", [1], GREEDY)), ("abort", ("a",))]:
        with pytest.raises(ValueError, match=rf"{call}\(\) must be called inside `with engine.rollout\(\):`"):
            getattr(engine, call)(*args)
    with pytest.raises(ValueError, match=r"generate_async\(\) must be called inside"):
        asyncio.run(engine.generate_async([1, 2], GREEDY))
    assert not engine.has_unfinished_requests()


def test_rollout_notes_its_whole_counters_at_exit():
    """engine.stats' rollout_* keys: the whole last rollout (two generate calls), where steps/decode_s are the
    last call's."""
    engine = make_engine()
    calls = []
    with engine.rollout():
        for lens in ([3, 5], [4]):
            engine.generate(prompts_for(lens), GREEDY)
            calls.append((engine.stats["steps"], engine.stats["decode_s"]))
    assert engine.stats["rollout_steps"] == sum(s for s, _ in calls) and calls[1][0] > 0
    assert engine.stats["rollout_decode_s"] == pytest.approx(sum(d for _, d in calls))
    assert engine.stats["rollout_preemptions"] == 0 and engine.stats["rollout_cuda_graph_capture_s"] == 0.0


def test_rollout_freezes_the_heap_out_of_the_gc_and_thaws_it():
    """Inside rollout() the objects that existed at entry are frozen out of the collector (the per-step outputs
    do not make full collections walk them); exit thaws the permanent generation, also after an error. A
    freeze made before entry (a library's at import: the GPU machine's process starts with 375 objects
    frozen) does not stop the rollout's, and is thawed with it."""
    import gc

    engine = make_engine()
    for frozen_before in (False, True):
        gc.unfreeze()
        if frozen_before:
            gc.freeze()
        before = gc.get_freeze_count()
        with engine.rollout():
            garbage = [object() for _ in range(1000)]  # noqa: F841 - made after entry: not frozen
            assert gc.get_freeze_count() > before  # the engine and everything made since were frozen
            frozen = gc.get_freeze_count()
            engine.generate(prompts_for([3]), GREEDY)
            assert gc.get_freeze_count() <= frozen  # the step loop's objects are not frozen
        assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError, match="inside"):
        with engine.rollout():
            raise RuntimeError("inside")
    assert gc.get_freeze_count() == 0


def test_generate_async_200_tasks_equal_generate():
    """200 concurrent tasks (one stepping task batches them, 64 rows at a time) give generate's outputs,
    bitwise; then 100 two-turn conversations, each turn appending the last reply, finish without deadlock."""
    engine = make_engine(max_num_seqs=64, max_num_batched_tokens=256)
    prompts = prompts_for([3 + i % 7 for i in range(200)], seed=4)
    params = [he.SamplingParams(temperature=1.0, max_tokens=2 + i % 3, seed=i, n=1 + (i % 5 == 0)) for i in range(200)]

    async def conversation(prompt, i):
        first = await engine.generate_async(prompt, he.SamplingParams(max_tokens=2, seed=i))
        await asyncio.sleep(0)
        reply = first.outputs[0].token_ids
        second = await engine.generate_async(prompt + reply + [7], he.SamplingParams(max_tokens=3, seed=i))
        return first, second

    async def main():
        with engine.rollout():
            expected = engine.generate(prompts, params)
        with engine.rollout():
            got = await asyncio.gather(*(engine.generate_async(p, sp) for p, sp in zip(prompts, params)))
            turns = await asyncio.gather(*(conversation(p, i) for i, p in enumerate(prompts[:100])))
            assert not engine.has_unfinished_requests()
        return expected, got, turns

    expected, got, turns = asyncio.run(main())
    assert completions(got) == completions(expected)
    assert sorted(int(o.request_id.split("-")[1]) for o in got) == list(range(200))
    assert all(len(a.outputs[0].token_ids) == 2 and len(b.outputs[0].token_ids) == 3 and b.finished for a, b in turns)


def _ppo_batch(outs):
    """A one-token-advantage batch over the completions (just something to step on)."""
    ids, mask, old, adv = [], [], [], []
    for out in outs:
        for c in out.outputs:
            p = out.prompt_token_ids
            ids.append(torch.tensor(p + c.token_ids))
            m = torch.zeros(len(p) + len(c.token_ids) - 1)
            m[len(p) - 1:] = 1
            o = torch.zeros_like(m)
            o[len(p) - 1:] = torch.tensor(c.logprobs)
            mask.append(m), old.append(o), adv.append(m.clone())
    return he.PPOBatch(input_ids=ids, response_mask=mask, old_logprobs=old, advantages=adv)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_kept_requests_resume_after_a_ppo_step(async_scheduling):
    """rollout(keep_unfinished=True) keeps the unfinished requests; after a ppo_step (lr 0: the same weights)
    the next rollout resumes them with their KV recomputed: greedy and seeded tokens as without the break,
    versions [0] * k + [1] * rest. A request that finished before the break is reported then, not kept."""
    prompts = prompts_for([5, 9, 3])
    params = [he.SamplingParams(temperature=0.0, max_tokens=10), he.SamplingParams(n=2, max_tokens=12, seed=7),
              he.SamplingParams(max_tokens=2, seed=1)]
    ids = ["greedy", "seeded", "short"]
    ref = make_engine(tuning=he.EngineTuning(async_scheduling=async_scheduling))
    with ref.rollout():
        expected = run_requests(ref, prompts, params, ids)

    engine = make_engine(tuning=he.EngineTuning(async_scheduling=async_scheduling))
    with engine.rollout(keep_unfinished=True):
        for rid, p, sp in zip(ids, prompts, params):
            engine.add_request(rid, p, sp)
        first = {}
        for _ in range(5):
            first |= {o.request_id: o for o in engine.step()}
    assert first["short"].finished and not first["greedy"].finished
    assert engine.has_unfinished_requests()  # kept
    assert engine.policy_version == 0
    engine.ppo_step(_ppo_batch(expected), he.PPOConfig(lr=lambda step: 0.0))
    assert engine.policy_version == 1
    with engine.rollout():
        got = {}
        while engine.has_unfinished_requests():
            got |= {o.request_id: o for o in engine.step() if o.finished}
    assert sorted(got) == ["greedy", "seeded"]
    for rid, exp in zip(ids[:2], expected[:2]):
        for c, e, before in zip(got[rid].outputs, exp.outputs, first[rid].outputs):
            k = len(before.token_ids)  # reported before the break; one more may have been in flight
            old = c.policy_versions.count(0)
            assert 0 < k <= old <= k + async_scheduling and old < len(e.token_ids)
            assert c.policy_versions == [0] * old + [1] * (len(c.token_ids) - old)
            assert c.token_ids == e.token_ids and c.finish_reason == e.finish_reason
            assert c.logprobs[:k] == before.logprobs  # kept as sampled
            torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(e.logprobs), rtol=0, atol=1e-5)
    assert not engine.has_unfinished_requests()


def test_a_request_finishing_at_the_break_is_reported_by_the_next_rollout():
    """Its last token was in flight when the rollout closed: read then, under the old version, and
    reported by the next rollout's first step()."""
    engine = make_engine()
    with engine.rollout(keep_unfinished=True):
        engine.add_request("a", [1, 2, 3], he.SamplingParams(max_tokens=2, seed=0))
        assert [len(o.outputs[0].token_ids) for o in engine.step()] == [1]
        assert engine.step() == [] and engine._session.inflight is not None
    assert engine.has_unfinished_requests()
    fake = he.RequestOutput([1, 2, 3], [he.CompletionOutput(0, [4, 5], [-1.0, -1.0], "length")])
    engine.ppo_step(_ppo_batch([fake]), he.PPOConfig(lr=1e-3))
    with engine.rollout():
        assert engine.has_unfinished_requests()
        (out,) = engine.step()
        assert not engine.has_unfinished_requests()
    assert out.finished and out.outputs[0].finish_reason == "length" and out.outputs[0].policy_versions == [0, 0]


def test_generate_async_tasks_wait_across_a_kept_rollout():
    """Partial rollout with asyncio: leave the rollout once 2 of 4 tasks finished, keeping the others; their
    tasks wait through a ppo_step and finish in the next rollout (the stepping task restarts there)."""
    prompts = prompts_for([4, 6, 5, 7])
    params = [he.SamplingParams(max_tokens=n, seed=i) for i, n in enumerate([2, 3, 14, 16])]
    ref = make_engine()
    with ref.rollout():
        expected = ref.generate(prompts, params)
    engine = make_engine()

    async def main():
        with engine.rollout(keep_unfinished=True):
            tasks = [asyncio.create_task(engine.generate_async(p, sp)) for p, sp in zip(prompts, params)]
            while sum(t.done() for t in tasks) < 2:
                await asyncio.sleep(0)
        assert engine.has_unfinished_requests() and not any(t.done() for t in tasks[2:])
        engine.ppo_step(_ppo_batch(expected), he.PPOConfig(lr=lambda step: 0.0))
        with engine.rollout():
            return await asyncio.gather(*tasks)

    got = asyncio.run(main())
    assert [c.token_ids for o in got for c in o.outputs] == [c.token_ids for o in expected for c in o.outputs]
    for out in got:
        versions = out.outputs[0].policy_versions
        old = versions.count(0)
        assert versions == [0] * old + [1] * (len(versions) - old)
        assert (old == len(versions)) == (out.request_id in ("async-0", "async-1")) and old > 0


def test_kept_requests_are_aborted_on_a_plain_exit_and_on_an_error():
    engine = make_engine()
    with engine.rollout():
        engine.add_request("a", [1, 2, 3], GREEDY)
        engine.step()
    assert not engine.has_unfinished_requests()
    with pytest.raises(RuntimeError, match="boom"):
        with engine.rollout(keep_unfinished=True):
            engine.add_request("a", [1, 2, 3], GREEDY)
            engine.step()
            raise RuntimeError("boom")
    assert not engine.has_unfinished_requests()
    with engine.rollout():
        assert not engine.has_unfinished_requests() and engine.step() == []


def test_a_skipped_step_keeps_the_policy_version(monkeypatch):
    from hybridengine.train import trainer as trainer_module

    engine = make_engine()
    with engine.rollout():
        batch = _ppo_batch(engine.generate([[1, 2, 3]], GREEDY))
    engine.ppo_step(batch, he.PPOConfig(lr=1e-3))
    assert engine.policy_version == 1
    original = trainer_module.add_embedding_grad_

    def poisoned(embed_grad, *args):  # a NaN gradient after the batch passed validation
        original(embed_grad, *args)
        embed_grad[0, 0] = float("nan")

    monkeypatch.setattr(trainer_module, "add_embedding_grad_", poisoned)
    assert engine.ppo_step(batch, he.PPOConfig(lr=1e-3, nonfinite_grad="skip"))["skipped"] == 1
    assert engine.policy_version == 1
    monkeypatch.undo()
    engine.ppo_step(batch, he.PPOConfig(lr=1e-3))
    assert engine.policy_version == 2


# -- the TP driver on 2 gloo ranks ----------------------------------------------------------------------

TP_PROMPTS = prompts_for([3, 9, 6, 12, 5], seed=2)
TP_PARAMS = [he.SamplingParams(n=2, temperature=0.0, max_tokens=8), he.SamplingParams(temperature=0.0, max_tokens=10),
             he.SamplingParams(temperature=0.0, max_tokens=6), he.SamplingParams(temperature=0.0, max_tokens=12),
             he.SamplingParams(n=2, temperature=0.0, max_tokens=7)]


def _tp_script(engine, driver):
    """Rollout 1: three requests, an abort, a generate call in the middle (every rank calls it), kept on exit;
    rollout 2: the kept ones resume and a generate_async request joins. The follower runs step() until the
    driver leaves each block. Returns {id: final completion tokens}, generate's tokens."""
    done = {}

    def note(outs):
        done.update({o.request_id: [c.token_ids for c in o.outputs] for o in outs if o.finished})

    with engine.rollout(keep_unfinished=True):
        if driver:
            for i in range(3):
                engine.add_request(f"r{i}", TP_PROMPTS[i], TP_PARAMS[i])
            note(engine.step())
            engine.add_request("gone", TP_PROMPTS[3], TP_PARAMS[3])
            note(engine.step())
            engine.abort("gone")
            gen = engine.generate([TP_PROMPTS[4]], TP_PARAMS[4])
            for _ in range(2):
                note(engine.step())
        else:
            note(engine.step())
            note(engine.step())
            gen = engine.generate([[0]], TP_PARAMS[0])  # the driver's batch runs
            while engine.has_unfinished_requests():
                note(engine.step())
    assert engine.has_unfinished_requests()

    async def drive():
        with engine.rollout():
            if driver:
                out = await engine.generate_async(TP_PROMPTS[3], TP_PARAMS[3])
                done["async"] = [c.token_ids for c in out.outputs]
                while engine.has_unfinished_requests():
                    note(engine.step())
            else:
                while engine.has_unfinished_requests():
                    note(engine.step())

    asyncio.run(drive())
    return done, [c.token_ids for c in gen[0].outputs]


def _tp_worker(rank, world, init_file, expected, errors):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with reporting(errors, f"rank {rank}"):
        engine = make_engine(tp=2)
        if rank == 1:
            with engine.rollout():
                with pytest.raises(ValueError, match=r"add_request\(\): under TP generation the TP group's first rank"):
                    engine.add_request("x", [1], GREEDY)
                while engine.has_unfinished_requests():
                    engine.step()
        else:
            with engine.rollout():
                pass
        done, gen = _tp_script(engine, rank == 0)
        want_done, want_gen = expected
        if rank == 0:
            assert done == want_done, (done, want_done)
        else:  # the follower sees the same requests finish, but not generate_async's (the driver's task)
            assert done == {k: v for k, v in want_done.items() if k != "async"}, (done, want_done)
        assert gen == want_gen


def test_tp_driver_on_two_gloo_ranks():
    """tg = 2: rank 0 drives (add_request, abort, generate, generate_async, keep_unfinished), rank 1 follows
    in step(); both see the greedy tokens of one process running the same calls."""
    expected = _tp_script(make_engine(), True)
    assert sorted(expected[0]) == ["async", "r0", "r1", "r2"]
    spawn(_tp_worker, 2, expected)
