"""Keys file parsing and reload, tenant scoping, request limits: the pure parts of
runtime/security.py and protos/limits.py."""
import pytest

from pagoda.protos.limits import Limits, check_fits, check_request
from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.runtime.security import Identity, KeyRing, read_keys, scoped_id, scoped_salt


def test_keys_file_format_and_reload(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# comment\n\nk1 alice\nk2 ops admin  # trailing comment\n")
    assert read_keys(str(path)) == {"k1": Identity("alice"), "k2": Identity("ops", True)}
    for bad in ("k1\n", "k1 alice root\n", "k1 a\nk1 b\n", "# nothing\n", "k1 al\x00ice\n"):
        path.write_text(bad)
        with pytest.raises(ValueError, match="keys"):
            read_keys(str(path))
    path.write_text("k1 alice\n")
    ring = KeyRing(str(path))
    assert ring.identify([("authorization", "Bearer k1")]) == Identity("alice")
    assert ring.identify([("authorization", "k1")]) is None and ring.identify([]) is None
    path.write_text("k1 alice extra\n")
    ring.reload()                                          # refused: the old keys stay
    assert ring.identify([("authorization", "Bearer k1")]) == Identity("alice")
    path.write_text("k3 bob\n")
    ring.reload()
    assert ring.identify([("authorization", "Bearer k1")]) is None
    assert ring.identify([("authorization", "Bearer k3")]) == Identity("bob")


def test_tenants_never_share_a_salt_or_an_id_and_admins_pass_through():
    alice, bob, admin = Identity("alice"), Identity("bob"), Identity("router", True)
    assert len({scoped_salt(alice, ""), scoped_salt(bob, ""), scoped_salt(None, "")}) == 3
    assert scoped_salt(alice, "x") != scoped_salt(bob, "x")
    # A tenant cannot pick a salt that lands in another tenant's namespace.
    assert scoped_salt(alice, "\x00tenant:bob\x00") != scoped_salt(bob, "")
    assert not scoped_salt(alice, "x").startswith(scoped_salt(bob, ""))
    assert scoped_id(alice, "r") != scoped_id(bob, "r")
    assert scoped_salt(admin, "s") == "s" and scoped_id(admin, "r") == "r"


def test_limits_name_the_field_and_its_flag():
    lim = Limits(max_n=4, max_prompt_bytes=100, max_messages=2, max_prompt_tokens=10)
    cases = [(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(n=5)), "n: ", "--max-n"),
             (pb.GenerateRequest(text="é" * 51), "text: ", "--max-prompt-bytes"),
             (pb.GenerateRequest(messages=[pb.ChatMessage(content="a")] * 3), "messages: ", "--max-messages"),
             (pb.GenerateRequest(token_ids=[1] * 11), "token_ids: ", "--max-prompt-tokens"),
             (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(stop=["a"] * 17)), "stop: ", "--max-stop")]
    for req, field, flag in cases:
        with pytest.raises(ValueError) as e:
            check_request(req, lim)
        assert str(e.value).startswith(field) and flag in str(e.value)
    check_request(pb.GenerateRequest(text="é" * 50, sampling=pb.SamplingParams(n=4)), lim)   # at the bound: ok
    check_request(pb.TokenizeRequest(text="hi"), lim)
    with pytest.raises(ValueError, match="^max_tokens: .* at most 6"):
        check_fits("text", 10, pb.SamplingParams(max_tokens=7), 16)
    with pytest.raises(ValueError, match="^messages: the prompt has 17"):
        check_fits("messages", 17, pb.SamplingParams(), 16)
    check_fits("text", 10, pb.SamplingParams(max_tokens=6), 16)
    check_fits("text", 10, pb.SamplingParams(), 16)       # the default max_tokens is clamped, not refused
