"""Structured output in the engine (CPU, offline LLM on the tiny model): grammars compile or name the
bad parameter, every constrained sample parses and validates, and unconstrained rows of the same
batch sample exactly as they would alone."""
from __future__ import annotations

import json
import os

import jsonschema
import pytest
import torch

from pagoda.gpu_worker.core.sampling_params import SamplingParams
from pagoda.gpu_worker.features.structured_output import (
    GrammarCompiler,
    GuidedSpec,
    apply_grammar_masks,
    spec_from_proto,
)
from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb

# Nested objects, enums, arrays and required fields, bounded everywhere (lengths, item counts,
# integer ranges, no extra properties) so that a random model's output always ends within max_tokens.
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "kind", "age", "tags", "owner"],
          "properties": {
              "name": {"type": "string", "maxLength": 8},
              "kind": {"enum": ["cat", "dog", "bird"]},
              "age": {"type": "integer", "minimum": 0, "maximum": 99},
              "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
              "owner": {"type": "object", "additionalProperties": False, "required": ["id", "vip"],
                        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                       "vip": {"type": "boolean"}}}}}
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def llm(tiny_model):
    from pagoda.gpu_worker.engine.llm import LLM
    return LLM(model=tiny_model, device="cpu", num_kv_blocks=256, max_model_len=512)


@pytest.fixture(scope="module")
def compiler(llm, tiny_model):
    with open(os.path.join(tiny_model, "tokenizer.json"), encoding="utf-8") as f:
        return GrammarCompiler(f.read(), llm.engine.vocab_size, llm.engine.eos_token_ids)


def guided(compiler, kind, value, **kw) -> SamplingParams:
    return SamplingParams(structured_output=compiler.compile(GuidedSpec(kind, value)), **kw)


def test_invalid_grammars_name_the_parameter(compiler):
    for kind, value, param in [("json_schema", '{"type": "no-such-type"}', "response_format"),
                               ("json_schema", "{not json", "response_format"),
                               ("json_schema", "[1, 2]", "response_format"),
                               ("regex", "(unclosed", "guided_regex"),
                               ("choice", "[]", "guided_choice")]:
        with pytest.raises(ValueError, match=f"^{param}: "):
            compiler.compile(GuidedSpec(kind, value))


def test_a_tokenizer_llguidance_cannot_read_is_named_in_the_error():
    broken = GrammarCompiler('{"model": "no tokenizer"}', 640, [2])
    with pytest.raises(ValueError, match="^guided_choice: structured output is unavailable"):
        broken.compile(GuidedSpec("choice", '["a"]'))


def test_compiled_grammars_are_cached_per_spec(compiler):
    a = compiler.compile(GuidedSpec("json_schema", json.dumps(SCHEMA)))
    assert compiler.compile(GuidedSpec("json_schema", json.dumps(SCHEMA))) is a
    assert compiler.compile(GuidedSpec("regex", "[0-9]{3}")) is not a


def test_spec_from_proto():
    assert spec_from_proto(pb.StructuredOutput()) is None
    assert spec_from_proto(pb.StructuredOutput(choice=["a", "b"])) == GuidedSpec("choice", '["a", "b"]')
    assert spec_from_proto(pb.StructuredOutput(json_object=True)) == GuidedSpec("json_object", "")
    with pytest.raises(ValueError, match="^response_format: give one kind"):
        spec_from_proto(pb.StructuredOutput(json_schema="{}", regex="a"))


def test_schema_samples_at_temperature_1_all_validate(llm, compiler):
    params = [guided(compiler, "json_schema", json.dumps(SCHEMA), temperature=1.0, seed=s, max_tokens=MAX_TOKENS)
              for s in range(24)]
    outs = llm.generate(["Describe a pet as JSON:"] * len(params), params)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_json_object_regex_and_choice(llm, compiler):
    choices = ["yes", "no", "maybe later"]
    outs = llm.generate(["Answer:"] * 3, [
        guided(compiler, "choice", json.dumps(choices), temperature=1.0, seed=1, n=4, max_tokens=16),
        guided(compiler, "regex", r"[A-Z][a-z]{2,5}-[0-9]{2}", temperature=1.0, seed=2, max_tokens=24),
        guided(compiler, "json_object", "", temperature=0, max_tokens=64)])
    assert all(c.text in choices and c.finish_reason == "stop" for c in outs[0].outputs)
    import re
    assert re.fullmatch(r"[A-Z][a-z]{2,5}-[0-9]{2}", outs[1].outputs[0].text)
    if outs[2].outputs[0].finish_reason == "stop":       # greedy may run long inside a string
        assert isinstance(json.loads(outs[2].outputs[0].text), dict)
    else:
        assert outs[2].outputs[0].text.startswith("{")


def test_a_grammar_spelling_an_added_token_survives_the_model_writing_it(llm, compiler, tiny_model):
    """<tool_call> is an added token that is not special: a grammar that spells it as text still
    matches when the model writes that one token (llguidance alone took it for a special token and
    ended the sequence there)."""
    from tokenizers import Tokenizer

    from pagoda.gpu_worker.features.structured_output import plain_added_tokens
    tok = Tokenizer.from_file(os.path.join(tiny_model, "tokenizer.json"))
    call = '<tool_call>{"name": "f"}</tool_call>'
    state = compiler.compile(GuidedSpec("choice", json.dumps([call]))).new_state()
    ids = tok.encode(call, add_special_tokens=False).ids
    assert ids[0] == tok.token_to_id("<tool_call>")       # one token, as the model writes it
    state.sync(ids)
    assert not state.matcher.is_error() and state.matcher.is_accepting()
    out = llm.generate(["Call:"], [guided(compiler, "choice", json.dumps([call]), temperature=0, max_tokens=40)])
    assert out[0].outputs[0].text == call and out[0].outputs[0].finish_reason == "stop"
    # Special tokens stay special; a tokenizer without a BPE vocabulary is passed through.
    moved = json.loads(plain_added_tokens(open(os.path.join(tiny_model, "tokenizer.json")).read()))
    assert {t["content"] for t in moved["added_tokens"]} >= {"<s>", "</s>", "<|im_end|>"}
    assert "<tool_call>" in moved["model"]["vocab"]
    assert plain_added_tokens('{"model": {"vocab": [["a", 0.0]]}}') == '{"model": {"vocab": [["a", 0.0]]}}'


def test_unconstrained_rows_keep_greedy_parity(llm, compiler):
    prompts = ["The sea is", "Once upon a time", "Caches are"]
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain)]
    schema = guided(compiler, "json_schema", json.dumps(SCHEMA), temperature=1.0, seed=5, max_tokens=MAX_TOKENS)
    mixed = llm.generate([prompts[0], "Pet:", prompts[1], "Pet:", prompts[2]],
                         [plain, schema, plain, schema, plain])
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 4)] == alone
    for i in (1, 3):
        jsonschema.validate(json.loads(mixed[i].outputs[0].text), SCHEMA)


def test_mask_leaves_unconstrained_rows_untouched(compiler):
    state = compiler.compile(GuidedSpec("choice", '["yes", "no"]')).new_state()
    vocab = compiler.vocab_size
    logits = torch.randn(3, vocab)
    before = logits.clone()
    apply_grammar_masks(logits, [None, state, None], [[], [], []])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = torch.isfinite(logits[1])
    assert 0 < int(allowed.sum()) < vocab
    assert torch.equal(logits[1][allowed], before[1][allowed])


def test_async_scheduling_holds_a_constrained_request_until_its_token_is_back(tiny_model, llm, compiler):
    """A grammar's next mask is worked out on the host from the token just sampled, so under async
    scheduling a constrained request skips the step launched while its token is in flight; the
    free-running request beside it is in every step. Outputs equal the synchronous engine's."""
    from pagoda.gpu_worker.engine.llm import LLM
    pipe = LLM(model=tiny_model, device="cpu", num_kv_blocks=256, max_model_len=512, async_scheduling="on")
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              guided(compiler, "json_schema", json.dumps(SCHEMA), temperature=1.0, seed=5, max_tokens=MAX_TOKENS)]
    prompts = ["The sea is", "Pet:"]
    launch, steps = pipe.engine.runner.launch, []

    def logged(out):
        steps.append({pipe.engine.scheduler.requests[s.req_id].parent_id for s in out.scheduled})
        return launch(out)

    pipe.engine.runner.launch = logged
    got = pipe.generate(prompts, params)
    ids = [o.request_id for o in got]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    jsonschema.validate(json.loads(got[1].outputs[0].text), SCHEMA)
    # While both run: the free request in every step (20 of them), the constrained one in every
    # other step (alone, it runs every step: nothing else could be launched meanwhile).
    both = steps[:20]
    assert all(ids[0] in s for s in both)
    assert not any(ids[1] in a and ids[1] in b for a, b in zip(both, both[1:]))
    assert sum(ids[1] in s for s in both) == 10
