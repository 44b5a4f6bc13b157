"""The control channel's schema (app/protocol.py): every message survives encode/decode, an unknown op, a
missing field or a value of the wrong kind is a clear ``ProtocolError``, the op names live in app/protocol.py
alone, step features travel as the named ``StepFeatures`` the router reads back by name, and a prompt
travels as token ids (the replica never tokenizes it) while the ingress decodes text incrementally."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
from pathlib import Path

import pytest

from app.protocol import (
    OPS,
    Abort,
    AcceptedItem,
    Add,
    Done,
    Draining,
    ErrorItem,
    Hello,
    ProgressBatch,
    ProtocolError,
    Ready,
    Resume,
    SamplingParams,
    StepItem,
    Thresholds,
    Tick,
    decode,
    encode,
    from_wire,
    op_of,
    to_wire,
)
from predictors.features import STEP_FEATURES, StepFeatures, step_row

ROOT = Path(__file__).resolve().parents[1]
FEATURES = StepFeatures(0.85, 256.0, 0.25, 0.5, 7.0, 3.0, 0.11, 0.32, 0.54, 0.5, 0.76)

# every message, each field away from its default at least once
EXAMPLES = [
    Hello("s3cret", 2),
    Ready(2),
    Add("r1", [5, 6, 7]),
    Add("r2", [1, 2], SamplingParams(max_tokens=64, threshold=0.8, cache="prefix", temperature=0.7, top_p=0.9,
                                     top_k=40, seed=123, stop_token_ids=(2,), ignore_eos=True, logprobs=True,
                                     decoding="joint_threshold", decoding_config={"edit_threshold": 0.8}),
        slo_left_s=2.5, sent_at=1700000000.25, committed=[9, 10],
        resume=Resume([11, -1, 12], 2, 5, {"edits": {"3": 1}}, [-0.5, 0.0, -0.25]), canvas=True,
        est_rounds=41.5, planned=True, attempt=2),
    Abort("r1"),
    Thresholds(),
    Thresholds({"r1": 0.7, "r2": 0.95}, {"r1": 12.5}, after_round=41),
    Tick(1700000000.5, {"running": 3, "alive": True, "last_round_s": 0.012}),
    Draining(),
    ProgressBatch(1700000001.0, 42, 12.5),
    ProgressBatch(1700000001.0, 43, 12.5, {"prefill": 1, "denoise": 3}, {"prefill": 64, "denoise": 96},
                  {"running": 4, "waiting": 0}, [
                      AcceptedItem("r1", 0.4, 12),
                      AcceptedItem("r3", None, 5, attempt=1),
                      StepItem("r1", [], 1, True),
                      StepItem("r2", [11, 12], 5, False, features=FEATURES, attempt=2,
                               canvas={"step": 5, "block": [0, 8], "committed": [[3, 11]], "masked": [4, 5],
                                       "threshold": 0.9, "length": 64}),
                      StepItem("r4", [13], 9, False, done=Done("stop", 9, 17), attempt=1, logprobs=[-0.25]),
                      StepItem("r7", [], 3, False, resume=Resume([5, -1], 1, 2)),
                      ErrorItem("r5", "server overloaded: 256 requests already waiting", 429),
                      ErrorItem("r6", "round failed: boom", 500, attempt=3)]),
]


def test_every_message_and_item_kind_has_an_example():
    assert {op_of(m) for m in EXAMPLES} == set(OPS)
    kinds = {type(i) for m in EXAMPLES if isinstance(m, ProgressBatch) for i in m.items}
    assert kinds == {AcceptedItem, StepItem, ErrorItem}
    records = [*EXAMPLES, *(i for m in EXAMPLES if isinstance(m, ProgressBatch) for i in m.items)]
    for cls in {type(r) for r in records}:  # each field with a default is away from it somewhere
        for f in dataclasses.fields(cls):
            default = (f.default if f.default is not dataclasses.MISSING else
                       f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            if default is not None or f.default is None:
                assert any(type(r) is cls and getattr(r, f.name) != default for r in records), (cls, f.name)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    body = encode(msg)
    assert isinstance(body, bytes) and json.loads(body)["op"] == op_of(msg)
    back = decode(body)
    assert back == msg and type(back) is type(msg)
    assert from_wire(to_wire(msg)) == msg
    for item in getattr(back, "items", ()):
        if isinstance(item, StepItem) and item.features is not None:
            assert type(item.features) is StepFeatures and item.features.as_row() == list(FEATURES)
        if isinstance(item, StepItem) and item.done is not None:
            assert type(item.done) is Done


def test_the_wire_leaves_defaults_out_and_sends_items_as_arrays():
    assert to_wire(Add("r1", [5, 6])) == {"op": "add", "req_id": "r1", "prompt_ids": [5, 6]}
    assert to_wire(Draining()) == {"op": "draining"}
    wire = to_wire(EXAMPLES[-1])
    assert wire["items"][2] == ["step", "r1", [], 1, True]  # trailing defaults left out
    assert wire["items"][3][:6] == ["step", "r2", [11, 12], 5, False, list(FEATURES)]
    assert wire["items"][0] == ["accepted", "r1", 0.4, 12] and wire["items"][-1][-1] == 3


@pytest.mark.parametrize("wire, match", [
    ({"op": "shout"}, r"unknown op 'shout'"),
    ({"req_id": "a"}, r"unknown op None"),
    ({"op": 3}, r"unknown op 3"),
    ([1, 2], r"a message is a JSON object"),
])
def test_an_unknown_op_is_a_clear_error(wire, match):
    with pytest.raises(ProtocolError, match=match):
        from_wire(wire)
    with pytest.raises(ProtocolError, match="must hold JSON"):
        decode(b"{not json")


def _required(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_a_missing_field_is_a_clear_error(msg):
    wire = to_wire(msg)
    op = wire["op"]
    for name in _required(type(msg)):
        broken = {k: v for k, v in wire.items() if k != name}
        with pytest.raises(ProtocolError) as err:
            from_wire(broken)
        assert str(err.value) == f"{op}: missing field {name!r}" and err.value.op == op
    for i, item in enumerate(wire.get("items", ())):  # an item cut short names the field it lacks
        cls = type(msg.items[i])
        need = _required(cls)
        broken = json.loads(json.dumps(wire))
        broken["items"][i] = item[:len(need)]
        with pytest.raises(ProtocolError, match=rf"batch\.items\[{i}\]: missing field '{need[-1]}'"):
            from_wire(broken)


@pytest.mark.parametrize("path, value, match", [
    (("req_id",), 7, r"add\.req_id: expected a string, got int"),
    (("prompt_ids",), ["a"], r"add\.prompt_ids: expected a list of token ids"),
    (("prompt_ids",), "1 2 3", r"add\.prompt_ids: expected a list of token ids"),
    (("params", "threshold"), "high", r"add\.params\.threshold: expected a number or null"),
    (("planned",), 1, r"add\.planned: expected a boolean"),
    (("params", "top_k"), 4.5, r"add\.params\.top_k: expected an integer"),
    (("params", "decoding"), 3, r"add\.params\.decoding: expected a string or null"),
    (("params", "decoding_config"), [], r"add\.params\.decoding_config: expected an object or null"),
    (("params",), [], r"add\.params: expected an object"),
    (("resume", "tail"), [1.5], r"add\.resume\.tail: expected a list of token ids"),
])
def test_a_value_of_the_wrong_kind_names_its_field(path, value, match):
    wire = to_wire(EXAMPLES[3])
    target = wire
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(ProtocolError, match=match) as err:
        from_wire(wire)
    assert err.value.op == "add" and err.value.req_id == ("r2" if path != ("req_id",) else None)


def test_a_bad_item_names_its_position():
    wire = to_wire(EXAMPLES[-1])
    wire["items"][3][5] = [0.5] * 10
    with pytest.raises(ProtocolError, match=r"batch\.items\[3\]\.features: expected an array of the 11 step"):
        from_wire(wire)
    wire = to_wire(EXAMPLES[-1])
    wire["items"][4][7] = {"finish_reason": "stop"}
    with pytest.raises(ProtocolError, match=r"batch\.items\[4\]\.done: missing field 'rounds'"):
        from_wire(wire)
    for bad in (["progress", "r1"], {"req_id": "r1"}, []):
        wire = to_wire(EXAMPLES[-1])
        wire["items"][1] = bad
        with pytest.raises(ProtocolError, match=r"batch\.items\[1\]: not a progress item"):
            from_wire(wire)


def test_fields_a_newer_peer_adds_are_ignored():
    assert from_wire({"op": "abort", "req_id": "a", "reason": "new"}) == Abort("a")
    wire = to_wire(EXAMPLES[-1])
    wire["items"][0] += [0, "more"]  # beyond AcceptedItem's fields
    assert from_wire(wire) == EXAMPLES[-1]


def test_only_messages_are_encoded():
    with pytest.raises(ProtocolError, match="dict is not a message"):
        encode({"op": "abort", "req_id": "a"})


def test_sampling_from_the_ingress_dict():
    assert SamplingParams.from_dict(None) == SamplingParams()
    s = SamplingParams.from_dict({"temperature": 0, "top_p": 1, "top_k": 40, "seed": None, "stop_token_ids": (2, 3),
                                  "decoding": "credit", "decoding_config": {"alpha": 0.5}})
    assert s == SamplingParams(temperature=0.0, top_p=1.0, top_k=40, stop_token_ids=(2, 3), decoding="credit",
                               decoding_config={"alpha": 0.5}) and type(s.temperature) is float
    with pytest.raises(ValueError, match="unknown sampling fields \\['typo'\\]"):
        SamplingParams.from_dict({"typo": 1})
    with pytest.raises(ValueError, match="bad sampling parameter top_k='many'"):
        SamplingParams.from_dict({"top_k": "many"})
    with pytest.raises(ValueError, match="bad sampling parameter decoding_config=3"):
        SamplingParams.from_dict({"decoding_config": 3})


def test_no_module_but_the_protocol_spells_an_op():
    """The op names are app/protocol.py's constants: no other source file writes a message by hand."""
    pattern = re.compile(r"""["']op["']""")
    here = Path(__file__).resolve()
    offenders = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
                 if ".venv" not in p.parts and p != here and p != ROOT / "app" / "protocol.py"
                 and pattern.search(p.read_text(errors="replace"))]
    assert not offenders, offenders
    source = (ROOT / "app" / "protocol.py").read_text()
    for op in OPS:
        assert source.count(f'"{op}"') == 1, op  # spelled once: its constant


# ---- step features ---------------------------------------------------------------------------------------

def test_step_features_are_named_in_the_shipped_models_column_order():
    assert STEP_FEATURES == ("threshold", "output_len", "progress", "block_progress", "blocks_left", "step_in_block",
                             "conf_min", "conf_q25", "conf_median", "conf_mean", "conf_q75")
    f = step_row(0.8, 64, 16, 4, 8, 3, 2, [0.1, 0.2, 0.3, 0.4, 0.5])
    assert f.as_row() == [0.8, 64.0, 0.25, 0.5, 3.0, 2.0, 0.1, 0.2, 0.3, 0.4, 0.5]
    assert f.as_row(0.7)[0] == 0.7 and f.threshold == 0.8 and f.conf_stats == (0.1, 0.2, 0.3, 0.4, 0.5)
    with pytest.raises(ValueError, match="conf_stats"):
        step_row(0.8, 64, 16, 4, 8, 3, 2, [0.1])


def test_the_router_reads_a_step_item_s_features_by_name_and_asks_the_estimator_the_same_row():
    """A step item's features, through the dispatcher, land on the request's router state; the step
    estimator's row of that state (``cluster.estimator.feature_row``) is the row the replica measured."""
    from app.config import AppConfig
    from app.dispatch import Dispatcher
    from cluster.estimator import feature_row
    from cluster.factory import build_router
    from engine.loading import resolve_model
    from engine.models.loader import load_config

    class Link:
        def __init__(self) -> None:
            self.sent = []

        def send(self, msg) -> bool:
            self.sent.append(msg)
            return True

    mcfg = load_config(resolve_model("tiny-bd"))
    d = Dispatcher(build_router(AppConfig(engine={"model": "tiny-bd", "slots": 8}), mcfg), lambda ids: "x",
                   block_tokens=mcfg.block_size, full_sequence=False, per_instance_limit=64)
    link = Link()
    assert d.attach("r0", 1, link, read=False) == 0
    d.submit("a", [1, 2, 3], 256, slo_ms=60_000)
    (add,) = link.sent
    assert isinstance(add, Add) and add.prompt_ids == [1, 2, 3]
    state = d.driver.request("a")
    assert state is d.live["a"].state
    f = StepFeatures(add.params.threshold or 0.9, float(state.output_tokens), 0.25, 0.5, 7.0, 3.0, 0.1, 0.2, 0.3,
                     0.4, 0.5)
    d.handle_batch(0, decode(encode(ProgressBatch(time.time(), 1, 10.0, {"denoise": 1}, items=[
        AcceptedItem("a", 0.1, 3, add.attempt), StepItem("a", [4, 5], 1, False, features=f, attempt=add.attempt)]))))
    assert (state.progress, state.block_progress, state.blocks_left, state.step_in_block) == (0.25, 0.5, 7, 3)
    assert state.conf_stats == f.conf_stats
    assert feature_row(state, f.threshold) == f.as_row()
    g = f._replace(progress=0.5, block_progress=1.0, conf_min=0.2)  # a denoising step (the first was its prefill)
    d.handle_batch(0, decode(encode(ProgressBatch(time.time(), 2, 10.0, {"denoise": 1}, items=[
        StepItem("a", [6], 2, False, features=g, attempt=add.attempt)]))))
    assert feature_row(state, 0.7) == g.as_row(0.7) and state.progress == 0.5
    assert d.live["a"].rows == [g] and d.live["a"].committed == [4, 5, 6]


# ---- a prompt travels as ids; text decodes incrementally -------------------------------------------------

def test_the_replica_and_its_tensor_parallel_ranks_receive_ids_and_never_tokenize():
    """An add carries the prompt's token ids: the replica serves it without its tokenizer's encoders, and
    the commands a tensor-parallel instance sends its follower ranks carry the same ids."""
    from app.channel import Link
    from tests.builders import ids, make_replica

    mirrored: list[tuple] = []

    def mirror(commands, plan):
        mirrored.extend(commands)
        return lambda: None

    replica = make_replica(slots=2, mirror=mirror)
    tok = replica.loop.instance.engine.tokenizer

    def refuse(*args, **kwargs):
        raise AssertionError("the replica tokenized a prompt")

    for name in ("encode", "prompt_ids", "chat_ids", "completion_ids"):
        if hasattr(tok, name):
            setattr(tok, name, refuse)
    prompt = ids("rev: abcdefgh")

    async def main():
        link = await Link.open(**replica.info())
        link.send(Add("a", prompt, SamplingParams(max_tokens=16, threshold=0.9), attempt=4))
        items = []
        while not any(isinstance(i, StepItem) and i.done is not None for i in items):
            msg = await asyncio.wait_for(link.recv(), 30)
            if isinstance(msg, ProgressBatch):
                items += msg.items
        link.close()
        return items

    try:
        items = asyncio.run(main())
    finally:
        replica.close()
    assert isinstance(items[0], AcceptedItem) and items[0].prompt_tokens == len(prompt)
    assert all(i.attempt == 4 for i in items) and items[-1].done.finish_reason in ("stop", "length")
    (add,) = [c for c in mirrored if isinstance(c, Add)]
    assert add.prompt_ids == prompt and all(type(t) is int for t in add.prompt_ids)


def test_a_malformed_add_is_refused_by_its_id():
    """A frame that is no message: the replica logs it; a malformed add gets an error item for its id, so its
    sender does not wait for it forever."""
    from app.channel import HEADER, Link
    from tests.builders import make_replica

    replica = make_replica(slots=2)

    async def main():
        link = await Link.open(**replica.info())
        body = json.dumps({"op": "add", "req_id": "bad", "prompt_ids": ["x"]}).encode()
        link.writer.write(HEADER.pack(len(body)) + body)
        body = json.dumps({"op": "nonsense"}).encode()  # skipped: the connection stays
        link.writer.write(HEADER.pack(len(body)) + body)
        while True:
            msg = await asyncio.wait_for(link.recv(), 30)
            errors = [i for i in getattr(msg, "items", ()) if isinstance(i, ErrorItem)]
            if errors:
                link.close()
                return errors

    try:
        (err,) = asyncio.run(main())
    finally:
        replica.close()
    assert err.req_id == "bad" and err.status == 400 and "add.prompt_ids: expected a list of token ids" in err.message


def test_the_ingress_decodes_each_token_a_bounded_number_of_times():
    """Streaming a long answer token by token decodes a short window per step, not the whole text so far:
    the ids decoded in all stay linear in the answer's length (the final flush decodes it once)."""
    from engine.tokenizer import OutputText

    decoded = [0]

    def decode_bytes(token_ids) -> str:
        decoded[0] += len(token_ids)
        return bytes(token_ids).decode("utf-8", "replace")

    text = ("Grüße, 日本 🙂 " * 200).encode()
    out = OutputText(decode_bytes, ["STOP"])
    streamed = "".join(out.push([b]) for b in text)
    during = decoded[0]
    streamed += out.finish()
    assert streamed == text.decode()
    assert during <= 8 * len(text), during  # a window of a few ids per push; whole-text decoding would be ~n²/2
    assert decoded[0] - during == len(text)  # the final flush: one decode of the whole answer


# ---- the handshake's version -------------------------------------------------------------------------------

def test_each_end_refuses_a_peer_of_another_protocol_version():
    """During a redeploy across a protocol change an ingress keeps to the replicas of its own version: a
    replica hangs up on a hello of another version (or none: the dict protocol's), and an ingress refuses a
    replica whose ready has another version (or none)."""
    import socket

    from app.channel import HEADER, ChannelError, Link, ReplicaChannel
    from app.protocol import VERSION

    replica = ReplicaChannel(lambda c, m: None, lambda c: None, "s", tick_s=60)
    try:
        for hello in ({"op": "hello", "secret": "s"}, {"op": "hello", "secret": "s", "version": VERSION + 1}):
            with socket.create_connection(replica.address) as sock:
                body = json.dumps(hello).encode()
                sock.sendall(HEADER.pack(len(body)) + body)
                sock.settimeout(5)
                assert sock.recv(16) == b""  # hung up, no ready
        assert not replica.peers

        async def ours():
            link = await Link.open(*replica.address, "s", timeout_s=5)
            link.close()

        asyncio.run(ours())  # the same version connects
    finally:
        replica.close()

    async def old_replica(ready: dict):
        async def serve(reader, writer):
            await reader.readexactly(HEADER.unpack(await reader.readexactly(HEADER.size))[0])
            body = json.dumps(ready).encode()
            writer.write(HEADER.pack(len(body)) + body)
            await writer.drain()
            await asyncio.sleep(1)
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        async with server:
            with pytest.raises(ChannelError, match="refused the handshake") as err:
                await Link.open("127.0.0.1", server.sockets[0].getsockname()[1], "s", timeout_s=5)
        return str(err.value)

    assert "ready: missing field 'version'" in asyncio.run(old_replica({"op": "ready"}))
    assert f"version {VERSION + 1}, this ingress {VERSION}" in asyncio.run(
        old_replica({"op": "ready", "version": VERSION + 1}))


def test_ready_is_the_first_frame_even_when_a_broadcast_comes_as_the_ingress_is_listed(monkeypatch):
    """A broadcast (a tick, round progress) at the moment a new connection is listed, before its writer runs:
    the ingress still gets its ready first (a tick that reached it first failed its handshake: "refused the
    handshake: Tick(...)"), and an ingress that has its ready is listed (tests/test_stalls.py counts on it)."""
    import threading

    import app.channel as channel_module
    from app.channel import Link, ReplicaChannel
    from app.protocol import Tick

    replica = ReplicaChannel(lambda c, m: None, lambda c: None, "s", tick_s=60)

    class Thread(threading.Thread):
        def start(self):  # the connection's writer starts just after it is listed: a broadcast comes first
            if self.name == "remask-channel-writer":
                replica.broadcast(Tick(time.time(), {}))
            super().start()

    monkeypatch.setattr(channel_module, "threading", type("threading", (), {**vars(threading), "Thread": Thread}))
    try:
        async def connect():
            link = await Link.open(*replica.address, "s", timeout_s=5)
            assert replica.peers  # listed once the ready is in
            msg = await asyncio.wait_for(link.recv(), 5)
            link.close()
            return msg

        assert isinstance(asyncio.run(connect()), Tick)  # the broadcast, after the ready
    finally:
        replica.close()
