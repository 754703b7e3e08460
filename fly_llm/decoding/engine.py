"""FLyEngine: batched speculative decoding with FLy's loose acceptance (docs/design.md §1–3).

One `step()` is one round for every row of the batch:

1. new requests are prefilled alone — from the longest prefix the prefix cache holds, and at
   most `prefill_chunk` prompt tokens per step — and spliced into the batch once their prompt is
   in (continuous batching);
2. the policy picks each row's draft length and stages; the cascade drafts (a constrained row's
   draft starts with the tokens its grammar forces and stops before a token it forbids);
3. ONE target forward scores [last token, drafts…] for all rows (ragged: right-padded); a
   constrained row's logits are masked by its grammar at every position, a row with penalties has
   them applied at every position over its context plus the drafts before it;
4. `verify` applies the FLy rule (or exact / rejection sampling) per row;
5. both KV caches are rolled back to each row's emitted length; emitted tokens are checked
   against EOS, max_tokens and stop strings; finished rows leave the batch.

Invariant per row: the target cache holds the row's context minus its last token, which is fed
first in the next round, so each round's forward is uniform: K+1 columns per row.
"""

from __future__ import annotations

import itertools
import logging
import random
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace

import torch
from jinja2.exceptions import TemplateError

from fly_llm.common.config import FLyConfig, SamplingParams
from fly_llm.common.constraints import Constraint
from fly_llm.decoding.cache import BatchKV
from fly_llm.decoding.grammar import CACHE_BYTES, MAX_GRAMMAR_BYTES, GrammarCompiler, apply_masks
from fly_llm.decoding.grammar_sandbox import WORKERS
from fly_llm.decoding.logprobs import Logprob, token_logprobs
from fly_llm.decoding.penalties import Penalty
from fly_llm.decoding.policy import AdaptivePolicy, PolicyState, RowAsk
from fly_llm.decoding.prefill import PromptFill
from fly_llm.decoding.prefix_cache import PrefixCache
from fly_llm.decoding.row_faults import RowFaults
from fly_llm.decoding.stages import NgramStage, RowStart, build_cascade
from fly_llm.decoding.text import Detokenizer, StopChecker
from fly_llm.decoding.verify import PAD_TOKEN, RowRules, RowSampling, Verdict, verify
from fly_llm.common.errors import BadRequest, FimUnsupported, FLyError, TooLong, contained, error_from_code
from fly_llm.common.fim import Infill, fim_tokens, infill_ids
from fly_llm.common.lru import LruCache
from fly_llm.model.quantization import quantization_of
from fly_llm.common.stats import FinishReason, PromptStats, RequestStats

log = logging.getLogger(__name__)

SCORED_PROMPT_BYTES = 16 << 20
"""Budget of the scored prompts kept (their log-probabilities), so the choices of one prompt (OpenAI's `n`) score it
once: a 4096-token prompt with 20 alternatives is about 7 MiB."""


def _scored_bytes(key: tuple[str, tuple[int, ...], int], logprobs: list[Logprob]) -> int:
    """About what a scored prompt's log-probabilities hold: a tuple, a float and a list per position, a tuple,
    an int and a float per alternative (the ints of the vocabulary are mostly shared)."""
    return len(key[1]) * 8 + len(logprobs) * (150 + 90 * key[2])


@dataclass
class RequestOutput:
    """What one request got from one step()."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    stats: RequestStats
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache, in whole blocks
    error: str | None = None  # set (with finished) when the request failed mid-output: its grammar, a row fault
    error_code: str = "BAD_REQUEST"  # the error's stable code (fly_llm.common.errors): INTERNAL for a row fault
    logprobs: list[Logprob] | None = None  # of new_token_ids, when the request asked (fly_llm.decoding.logprobs)
    prompt_logprobs: list[Logprob] | None = None  # of its prompt tokens but the first, in its first output


@dataclass
class Generation:
    """A finished request."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: RequestStats
    cached_tokens: int = 0


@dataclass
class _Request:
    id: str
    prompt: list[int]
    sampling: SamplingParams
    fly: FLyConfig
    max_new: int
    detok: Detokenizer
    stops: StopChecker
    seed: int | None  # what its sampling draws from (the request's seed, else a random one); None: greedy
    matcher: object | None = None  # the grammar's matcher at the start of the output (llguidance.LLMatcher)
    tokens: list[int] = field(default_factory=list)  # prompt + output: the row's context
    output: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    policy: PolicyState = field(default_factory=PolicyState)
    finish_reason: FinishReason | None = None
    fill: PromptFill | None = None  # its prompt's caches while it waits to join
    cached_tokens: int = 0  # whole prefix-cache blocks only: a partial block would tell a prompt token by token
    scope: str = ""  # the prefix-cache scope (tenant) it reads and writes
    logprobs: int | None = None  # top alternatives per token when it asks for log-probabilities, else None
    prompt_logprobs: list[Logprob] | bool = False  # asked for: True until its prefill scored the prompt


class FLyEngine:
    """Speculative decoding over a target, an optional draft model and their shared tokenizer.

    All calls must come from one thread, except `compile_constraint` (any thread, any time).
    `config` holds the defaults; each request may bring its own FLyConfig (k, window, θ, loose,
    stages) as long as the entropy measure is the engine's.
    `prefix_cache_bytes` bounds the prefix cache (0: off; blocks of `prefix_block` tokens, §3.5);
    `prefill_chunk` bounds the prompt tokens prefilled per step (0: no bound, §3.6);
    `grammar_cache_bytes` bounds the compiled grammars kept and `max_grammar_bytes` one grammar's
    compiled form; `grammar_workers` sandbox processes judge new grammars at once (`GrammarCompiler`, §1.5).
    """

    def __init__(self, target, tokenizer, draft=None, config: FLyConfig | None = None, *,
                 context_window: int | None = None, policy: AdaptivePolicy | None = None,
                 prefix_cache_bytes: int = 0, prefix_block: int = 16, prefill_chunk: int = 0,
                 grammar_cache_bytes: int = CACHE_BYTES, max_grammar_bytes: int = MAX_GRAMMAR_BYTES,
                 grammar_workers: int = WORKERS) -> None:
        self.target = target.eval()
        self.draft = draft.eval() if draft is not None else None
        self.tokenizer = tokenizer
        self.config = config or FLyConfig()
        self.context_window = context_window or int(getattr(target.config, "max_position_embeddings", 4096))
        self.device = next(target.parameters()).device
        head = target.get_output_embeddings()
        self._logits_device = _module_device(head, self.device)  # differs under device_map
        self.dtype = next(target.parameters()).dtype
        self.target_name = str(getattr(target.config, "_name_or_path", "") or type(target).__name__)
        self.draft_name = (str(getattr(draft.config, "_name_or_path", "") or type(draft).__name__)
                           if draft is not None else None)
        self.target_quantization = quantization_of(target)
        self.draft_quantization = quantization_of(draft) if draft is not None else "none"
        self.stats = RequestStats()
        self.policy = policy or AdaptivePolicy()
        self.fim = fim_tokens(tokenizer.get_vocab())  # None: the target cannot fill in the middle
        self._eos = _eos_ids(tokenizer, target) | (self.fim.ends if self.fim else frozenset())
        self.vocab_size = int(head.out_features) if head is not None else len(tokenizer)
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size, sorted(self._eos), cache_bytes=grammar_cache_bytes,
                                        max_grammar_bytes=max_grammar_bytes, workers=grammar_workers)
        self._local_ids = 0
        self._rows: list[_Request] = []
        self._waiting: list[_Request] = []
        self.prefill_chunk = prefill_chunk
        self._prefix = PrefixCache(prefix_cache_bytes, prefix_block)
        self._prompt = PromptStats()
        self._cascade = build_cascade(self.vocab_size, self.config, self.draft)
        self.reset()

    # -- requests ---------------------------------------------------------------------------

    def encode(self, prompt: str | None = None, messages: list[dict] | None = None,
               tools: list[dict] | None = None, add_special: bool = True, infill: Infill | None = None) -> list[int]:
        """Token ids of a prompt (with the tokenizer's special tokens unless not `add_special`), of chat
        messages (and the tools offered) through the chat template, or of a fill-in-the-middle request
        (`fly_llm.common.fim`; FimUnsupported when the target has no FIM tokens)."""
        if sum(x is not None for x in (prompt, messages, infill)) != 1:
            raise BadRequest("give exactly one of prompt, messages or infill")
        if tools and messages is None:
            raise BadRequest("tools need chat messages (the chat template renders them)")
        if infill is not None:
            return self._encode_infill(infill)
        if messages is not None:
            try:
                ids = self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                         tokenize=True)
            except TemplateError as exc:  # the template's own refusal (raise_exception): its words, one line
                reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else "no reason given"
                raise BadRequest(f"the chat template refused these messages: {reason}") from None
            except Exception as exc:  # noqa: BLE001 - a library's failure: named by its kind, its text only logged
                log.info("the chat template failed on a request's messages", exc_info=exc)
                raise BadRequest(f"the chat template could not render these messages ({type(exc).__name__})") from None
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special))

    def _encode_infill(self, infill: Infill) -> list[int]:
        """The FIM prompt: the target's FIM tokens as single ids, the request's text as plain text (a special
        token's name in it is text, never the token), after the tokenizer's leading special tokens (BOS)."""
        if self.fim is None:
            raise FimUnsupported(f"the model {self.target_name!r} has no fill-in-the-middle tokens "
                                 "(e.g. <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>)")

        def plain(text: str) -> list[int]:
            return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)) if text else []

        return infill_ids(infill, self.fim, plain, lead=list(self.tokenizer.encode("", add_special_tokens=True)))

    def decode(self, token_ids: list[int]) -> str:
        """The text of token ids, special tokens included; BadRequest for an id outside the vocabulary."""
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise BadRequest(f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def compile_constraint(self, constraint: Constraint | None, scope: str = ""):
        """The grammar matcher for a constraint (fly_llm.common.constraints), None when the output is free;
        BadRequest for a bad grammar. Safe from any thread while `step()` runs (a grammar not seen
        before in `scope`, a tenant, compiles in the sandbox first, then here; a repeated one is a copy)."""
        return self.grammars.for_constraint(constraint, scope)

    def compiled_matcher(self, constraint: Constraint, scope: str = ""):
        """The grammar matcher for a constraint whose grammar `scope` has compiled already, else None
        (nothing compiles: a caller tells a quick request from one that waits for a compile)."""
        return self.grammars.compiled(constraint, scope)

    def add_request(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                    fly: FLyConfig | None = None, constraint: Constraint | None = None, *, matcher=None,
                    cache_scope: str = "", logprobs: int | None = None, prompt_logprobs: bool = False,
                    min_indent: int = 0) -> None:
        """Queue a request; it is prefilled and joins the batch in the next step().

        `logprobs`: its outputs carry the target's log-probability of each emitted token and of this
        many top alternatives (`fly_llm.decoding.logprobs`); `prompt_logprobs` (with `logprobs`): its
        first output carries those of its prompt tokens (prefilled in full, past the prefix cache,
        unless its scope scored the same prompt with as many alternatives lately: the `n` choices of a prompt score
        it once).
        `constraint` (a grammar, regex or JSON Schema) constrains its output through a grammar
        compiled here, so a bad one raises BadRequest before the request is queued; a `matcher` from
        `compile_constraint` is used as it is instead. `cache_scope`: the prefix-cache scope (tenant)
        whose cached prefixes (and compiled grammars) it may use and where its own are kept. `min_indent` > 0: it
        also stops at the first line after the first indented less than that (a code completion leaving its
        block: fly_llm.decoding.text.StopChecker).
        """
        if not prompt_ids:
            raise BadRequest("the prompt is empty")
        if any(r.id == request_id for r in self._rows + self._waiting):
            raise BadRequest(f"duplicate request id {request_id!r}")
        room = self.context_window - len(prompt_ids)
        if room < 1:
            raise TooLong(f"the prompt has {len(prompt_ids)} tokens; the context window is {self.context_window}")
        fly = fly or self.config
        if (fly.entropy_measure, fly.entropy_top_k) != (self.config.entropy_measure, self.config.entropy_top_k):
            raise BadRequest("the entropy measure is set per engine, not per request")
        compiled_before = self.grammars.compile_s
        if matcher is None:
            matcher = self.grammars.for_constraint(constraint, cache_scope)
        seed = None
        if sampling.temperature > 0:
            seed = sampling.seed if sampling.seed is not None else random.getrandbits(63)
        self._waiting.append(_Request(
            id=request_id, prompt=list(prompt_ids), sampling=sampling, fly=fly,
            max_new=min(sampling.max_tokens, room), detok=Detokenizer(self.tokenizer, prompt_ids),
            stops=StopChecker(sampling.stop, min_indent), seed=seed, matcher=matcher, tokens=list(prompt_ids),
            stats=RequestStats(grammar_s=self.grammars.compile_s - compiled_before), scope=cache_scope,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs and logprobs is not None))

    def abort_request(self, request_id: str) -> bool:
        """Drop a request (waiting or running); False if it is unknown."""
        for i, req in enumerate(self._waiting):
            if req.id == request_id:
                del self._waiting[i]
                return True
        for i, req in enumerate(self._rows):
            if req.id == request_id:
                self._remove_rows([i])
                return True
        return False

    def reset(self) -> list[str]:
        """Drop every request, running or waiting, both caches and the prefix cache; return the dropped
        requests' ids.

        `step()` calls this when it fails, so an engine is never left half-way through a round.
        """
        dropped = [r.id for r in self._rows + self._waiting]
        self._prefix.clear()
        self._scored = LruCache(SCORED_PROMPT_BYTES, _scored_bytes)
        self._kv = BatchKV(self.device)
        self._cascade.reset()
        self._rows, self._waiting = [], []
        self._row_settings: tuple[RowRules, RowSampling | None, list[Penalty | None]] | None = None
        return dropped

    def check(self) -> None:
        """Assert the engine's invariants between steps (tests call this after every change).

        The target cache satisfies `BatchKV.check` and holds each row's context minus its last
        token; every stage holds one row per running request and keeps its own invariant
        (`Stage.check`: each grammar matcher at its row's context, the draft cache a prefix of the
        context plus drafts); the cached per-row settings (if any) have one
        row per running request; a waiting request's prompt caches hold no more than its prompt minus
        the last token; the prefix cache keeps its budget and index (`PrefixStore.check`), the scored
        prompts and the grammar caches theirs (`GrammarCompiler.check`).
        """
        rows = len(self._rows)
        self._kv.check()
        assert self._kv.lengths == [len(r.tokens) - 1 for r in self._rows], "target cache ≠ contexts minus last token"
        self._cascade.check([r.tokens for r in self._rows])
        assert self._row_settings is None or (len(self._row_settings[0].loose) == len(self._row_settings[2])
                                              == rows), "stale per-row settings"
        for req in self._waiting:
            if req.fill is not None:
                req.fill.check()
        self._prefix.check()
        self._scored.check()
        self.grammars.check()

    @property
    def prompt_stats(self) -> PromptStats:
        """Prompt tokens admitted, served from the prefix cache and prefilled so far; the cache's size."""
        store = self._prefix.store
        return self._prompt.model_copy(update=dict(cache_evictions=store.evictions, cache_bytes=store.bytes,
                                                   cache_budget_bytes=store.budget))

    def has_unfinished(self) -> bool:
        """Whether any request is running or waiting to join."""
        return bool(self._rows or self._waiting)

    @property
    def num_active(self) -> int:
        """Requests in the batch or waiting to join."""
        return len(self._rows) + len(self._waiting)

    # -- the round ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Admit waiting requests, then run one draft → verify → accept round for every row.

        A per-row stage that raises (sampling, grammar, log-probabilities, detokenizing) ends its
        row alone: its output has `error` and `error_code` (`fly_llm.decoding.row_faults`), the other
        rows go on. If anything else in the round raises (a model forward), every request in the engine
        is dropped (`reset`) and the exception propagates: the caller fails those requests; the engine
        is clean for the next ones.
        """
        try:
            return self._round()
        except BaseException:
            self.reset()
            raise

    @torch.inference_mode()
    def _round(self) -> list[RequestOutput]:
        self._admit()
        if not self._rows:
            return []
        rows = self._rows
        contexts = [r.tokens for r in rows]
        budgets = [r.max_new - len(r.output) - 1 for r in rows]
        behind = self._cascade.behind(contexts)  # a model round's catch-up prefill, a cost the policy weighs
        for b, req in enumerate(rows):
            req.policy.behind = {name: lags[b] for name, lags in behind.items()}
        plans = self.policy.plan_round([RowAsk(r.policy, r.fly, n, self._cascade.offered(first_round=not r.output))
                                        for r, n in zip(rows, budgets)])
        drafts = self._cascade.propose(contexts, plans, budgets, [r.fly for r in rows])
        forced = self._cascade.forced
        faults = RowFaults([r.id for r in rows])
        accepted, tokens, native, loose, logprobs = self._verify(contexts, drafts, [p.may_loosen for p in plans],
                                                                 faults)
        valid = [len(c) + a for c, a in zip(contexts, accepted)]  # context + kept drafts, both caches
        self._kv.truncate(valid)

        outputs: list[RequestOutput | None] = []
        finished = []
        for b, (req, plan, draft) in enumerate(zip(rows, plans, drafts)):
            if b in faults:  # its context gains the round's tokens, as the stages expect; it ends below
                req.tokens += tokens[b]
                outputs.append(None)
                continue
            n, a, f = len(draft), accepted[b], forced[b]
            req.stats.record_round(n, native[b], loose[b], a, used_draft_model=plan.model and n > f,
                                   used_ngram=NgramStage.name in plan.stages and n > f, forced=min(f, a))
            if a >= f:  # the policy sees its own drafts only: forced tokens are free and not its choice
                self.policy.observe(req.policy, plan, n - f, a - f, self._cascade.forwards[b],
                                    loose=sum(loose[b][f:a]), window=req.fly.window if req.fly.loose else None,
                                    batch_size=len(rows))
            outputs.append(self._emit_guarded(req, tokens[b], logprobs[b], faults.guard(b, "detokenizing")))
            if req.finish_reason is not None and b not in faults:
                finished.append(b)
        self._cascade.observe(valid, [r.tokens for r in rows])
        failed = dict(self._cascade.failures())  # only these rows end: the others go on
        for b, problem in failed.items():
            if b not in faults:
                outputs[b] = self._end_for_grammar(rows[b], outputs[b], problem)
        for b, error in faults.errors.items():
            outputs[b] = self._end_for_fault(rows[b], error)
        if finished or failed or faults.errors:
            self._remove_rows(sorted(set(finished) | failed.keys() | faults.errors.keys()))
        return outputs

    def _emit_guarded(self, req: _Request, tokens: list[int], logprobs: list[Logprob] | None,
                      guard: AbstractContextManager) -> RequestOutput | None:
        """`_emit` under its row's fault guard; on a fault the row's context is the round's tokens
        appended (what the stages expect of a row that goes on) and the output is None."""
        context = len(req.tokens)
        with guard:
            return self._emit(req, tokens, logprobs)
        req.tokens[context:] = tokens
        return None

    def _verify(self, contexts: list[list[int]], drafts: list[list[int]], may_loosen: list[bool], faults: RowFaults):
        """One target forward over [last token, drafts…] per row, then the FLy rule (loose only in
        the rows whose request has it on and whose round `may_loosen`).

        Returns per row, on the host: kept draft count, emitted tokens, and the native / loose
        flags of its draft positions (one device→host copy for all of it). A row whose sampling or
        log-probabilities raise is recorded in `faults` (its values are placeholders).
        """
        k = max(len(d) for d in drafts)
        input_ids = torch.tensor([[c[-1]] + d + [0] * (k - len(d)) for c, d in zip(contexts, drafts)],
                                 device=self.device)
        logits = self._kv.forward(self.target, input_ids)
        asking = {b: r.logprobs for b, r in enumerate(self._rows) if r.logprobs is not None}
        raw = {b: logits[b].clone() for b in asking}  # before the grammar masks: no cost for rows that do not ask
        apply_masks(logits, self._cascade.masks(drafts, k + 1))
        rules, sampling, penalties = self._settings_of_rows(logits.device)
        if any(p is not None for p in penalties):
            logits = self._penalized(logits, contexts, drafts, penalties, faults)
        lengths = torch.tensor([len(d) for d in drafts], device=logits.device)
        rules = replace(rules, loose=rules.loose & torch.tensor(may_loosen, device=logits.device))
        sampling = sampling.at([len(c) for c in contexts]) if sampling is not None else None
        verdict = self._verdict(input_ids[:, 1:], logits, lengths, rules, sampling, faults)
        host = torch.cat([verdict.accepted[:, None], verdict.tokens, verdict.native.long(), verdict.loose.long()],
                         1).tolist()
        accepted = [h[0] for h in host]
        tokens = [h[1:a + 2] for h, a in zip(host, accepted)]
        native = [[bool(x) for x in h[k + 2:k + 2 + len(d)]] for h, d in zip(host, drafts)]
        loose = [[bool(x) for x in h[2 * k + 2:2 * k + 2 + len(d)]] for h, d in zip(host, drafts)]
        logprobs: list[list[Logprob] | None] = [None] * len(drafts)
        for b in raw:
            with faults.guard(b, "log-probabilities"):
                logprobs[b] = token_logprobs(raw[b], tokens[b], asking[b])
        return accepted, tokens, native, loose, logprobs

    @staticmethod
    def _penalized(logits: torch.Tensor, contexts: list[list[int]], drafts: list[list[int]],
                   penalties: list[Penalty | None], faults: RowFaults) -> torch.Tensor:
        """The logits with each row's penalties applied at every position, over its context and the drafts
        before it (`fly_llm.decoding.penalties`), in float32 at least (half-precision steps would swallow a
        small penalty); a row whose penalty raises is recorded in `faults`."""
        logits = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
        for b, penalty in enumerate(penalties):
            if penalty is not None:
                with faults.guard(b, "sampling"):
                    penalty.apply_(logits[b], contexts[b], drafts[b])
        return logits

    @staticmethod
    def _verdict(drafts: torch.Tensor, logits: torch.Tensor, lengths: torch.Tensor, rules: RowRules,
                 sampling: RowSampling | None, faults: RowFaults) -> Verdict:
        """`verify` for the batch; if it raises, for each row alone, so the rows that raise are recorded in
        `faults` (their verdict: keep nothing, emit token 0) and the others get what the batch would have
        given them (a row's draws depend on its seed and positions alone)."""
        try:
            return verify(drafts, logits, lengths, rules, sampling)
        except BaseException as exc:
            if not contained(exc):
                raise
        k, verdicts = drafts.shape[1], []
        for b in range(len(drafts)):
            one = slice(b, b + 1)
            with faults.guard(b, "sampling"):
                verdict = verify(drafts[one], logits[one], lengths[one], rules.rows(one),
                                 sampling.rows(one) if sampling is not None else None)
            if b not in faults:  # a row that faulted earlier in the round (its penalties) ends too
                verdicts.append(verdict)
            else:
                nothing = torch.zeros(1, k, dtype=torch.bool, device=logits.device)
                verdicts.append(Verdict(accepted=torch.zeros(1, dtype=torch.long, device=logits.device),
                                        tokens=torch.tensor([[0] + [PAD_TOKEN] * k], device=logits.device),
                                        native=nothing, loose=nothing))
        return Verdict(*(torch.cat([getattr(v, name) for v in verdicts])
                         for name in ("accepted", "tokens", "native", "loose")))

    def _admit(self) -> None:
        """Prefill waiting requests' target caches in order, at most `prefill_chunk` prompt tokens in
        this step (0: no bound); each one whose prompt is complete joins the batch."""
        budget = self.prefill_chunk or sys.maxsize
        while self._waiting:
            req = self._waiting[0]
            if req.fill is None:
                req.fill = self._start_fill(req)
            computed = req.fill.advance(self.target, budget)
            self._prompt.prefilled_tokens += computed
            budget -= computed
            if not req.fill.done:
                return
            self._join(req)

    def _start_fill(self, req: _Request) -> PromptFill:
        """The request's prompt caches, seeded with the longest prefix of its prompt the prefix cache has.

        Only the target's is prefilled further: the draft cache joins with what the cache seeded, and
        the draft stage catches up in the row's first draft-model round — a cost the policy weighs, so
        a long prompt with a short answer never pays the draft model's prefill."""
        draft_kv = self._cascade.kv
        known = self._scored.get(self._scored_key(req)) if req.prompt_logprobs else None
        scored = req.prompt if req.prompt_logprobs and known is None else None  # its caches start empty: all scored
        target, draft = self._prefix.seed(req.prompt[:1] if scored else req.prompt, self.device,
                                          draft_kv.device if draft_kv is not None else None, scope=req.scope)
        block = self._prefix.store.block_size
        req.cached_tokens = target.lengths[0] // block * block  # reported in whole blocks; reused in full
        self._prompt.prompt_tokens += len(req.prompt)
        self._prompt.cached_tokens += req.cached_tokens
        return PromptFill(req.prompt[:-1], target, draft, scored=scored, top=req.logprobs or 0, logprobs=known or [])

    @staticmethod
    def _scored_key(req: _Request) -> tuple[str, tuple[int, ...], int]:
        """What a prompt's log-probabilities are kept under: its scope (tenant), tokens and alternatives asked."""
        return req.scope, tuple(req.prompt), req.logprobs or 0

    def _join(self, req: _Request) -> None:
        """Splice the first waiting request's complete prompt caches into the batch; keep its prompt's KV."""
        fill = req.fill
        self._prefix.save(fill.tokens, fill.target, 0, fill.draft, scope=req.scope)
        self._kv.add_row(fill.target)
        seeded = req.sampling.temperature > 0 and req.sampling.seed is not None  # draws depend on the drafts
        self._cascade.add_row(RowStart(len(req.prompt), fill.draft, req.matcher, req.scope, not seeded))
        self._rows.append(req)
        self._waiting.pop(0)
        if req.prompt_logprobs:
            req.prompt_logprobs = fill.logprobs
            if fill.scored is not None:  # the other choices of the prompt (OpenAI's n) take these, unscored
                self._scored.get_or_make(self._scored_key(req), lambda: fill.logprobs)
        req.fill = None
        self._row_settings = None

    def _settings_of_rows(self, device: torch.device) -> tuple[RowRules, RowSampling | None, list[Penalty | None]]:
        """The rows' FLy rules, sampling and penalties, built once per batch composition."""
        if self._row_settings is None:
            rows = self._rows
            sampling = None if all(r.seed is None for r in rows) else RowSampling(
                temperature=torch.tensor([r.sampling.temperature for r in rows]),
                top_p=torch.tensor([r.sampling.top_p for r in rows]), seeds=[r.seed for r in rows],
                top_k=[r.sampling.top_k for r in rows], min_p=[r.sampling.min_p for r in rows])
            penalties = [Penalty.of(r.sampling) for r in rows]
            self._row_settings = RowRules.from_configs([r.fly for r in rows], device), sampling, penalties
        return self._row_settings

    def _emit(self, req: _Request, tokens: list[int], logprobs: list[Logprob] | None = None) -> RequestOutput:
        """Append a round's tokens up to EOS / max_tokens / a stop string; count what is cut."""
        kept: list[int] = []
        for token in tokens:
            kept.append(token)
            req.output.append(token)
            req.tokens.append(token)
            if req.stops.active and req.stops.feed(req.detok.add([token])):
                req.finish_reason = "stop"  # checked per token so the cut is at the right token
            elif token in self._eos:
                req.finish_reason = "stop"
            elif len(req.output) >= req.max_new:
                req.finish_reason = "length"
            if req.finish_reason is not None:
                break
        if not req.stops.active:
            req.stops.feed(req.detok.add(kept))
        if len(kept) < len(tokens):
            req.stats.record_trim(len(tokens) - len(kept))
        finished = req.finish_reason is not None
        if finished:
            req.stops.feed(req.detok.flush())
        prompt_logprobs = req.prompt_logprobs if isinstance(req.prompt_logprobs, list) else None
        req.prompt_logprobs = False  # given once, with the first output
        return RequestOutput(request_id=req.id, new_token_ids=kept, new_text=req.stops.release(finished),
                             finished=finished, finish_reason=req.finish_reason, stats=req.stats,
                             prompt_tokens=len(req.prompt), cached_tokens=req.cached_tokens,
                             logprobs=None if logprobs is None else logprobs[:len(kept)],
                             prompt_logprobs=prompt_logprobs)

    @staticmethod
    def _end_for_fault(req: _Request, error: FLyError) -> RequestOutput:
        """End a row whose per-row stage raised: `error` (one line of ours) in its output, no new tokens."""
        req.finish_reason = req.finish_reason or "stop"
        return RequestOutput(request_id=req.id, new_token_ids=[], new_text="", finished=True,
                             finish_reason=req.finish_reason, stats=req.stats, prompt_tokens=len(req.prompt),
                             cached_tokens=req.cached_tokens, error=error.message, error_code=error.code)

    @staticmethod
    def _end_for_grammar(req: _Request, output: RequestOutput, problem: str) -> RequestOutput:
        """End a row whose grammar failed: its output says so in `error` (never a silent 'stop')."""
        req.finish_reason = req.finish_reason or "stop"
        return replace(output, finished=True, finish_reason=req.finish_reason, error=problem)

    def _remove_rows(self, indices: list[int]) -> None:
        """Drop rows from the batch, keeping their prompt + output KV in the prefix cache."""
        drop = set(indices)
        draft_kv = self._cascade.kv
        for i in indices:
            self.stats.merge(self._rows[i].stats)
            self._prefix.save(self._rows[i].tokens, self._kv, i, draft_kv, scope=self._rows[i].scope)
            self._cascade.answered(i, self._rows[i].tokens)
        keep = [i for i in range(len(self._rows)) if i not in drop]
        self._kv.remove_rows(keep)
        self._cascade.remove_rows(keep)
        self._rows = [self._rows[i] for i in keep]
        self._row_settings = None

    # -- convenience ----------------------------------------------------------------------------

    def _new_id(self, kind: str) -> str:
        self._local_ids += 1
        return f"{kind}-{self._local_ids}"

    def generate(self, prompts: str | list[str], sampling: SamplingParams | None = None,
                 fly: FLyConfig | None = None, constraint: Constraint | None = None) -> list[Generation]:
        """Generate for one or many prompts (batched together); one Generation per prompt, in order.

        Drives step() itself until these prompts finish: for in-process use, not next to a
        scheduler (outputs of other requests in the engine are not returned here). A prompt whose
        grammar fails mid-output raises BadRequest (the others are dropped).
        """
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        sampling = sampling or SamplingParams()
        ids = [self._new_id("generate") for _ in prompts]
        for rid, prompt in zip(ids, prompts):
            self.add_request(rid, self.encode(prompt), sampling, fly, constraint)
        texts: dict[str, list[str]] = {i: [] for i in ids}
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        results: dict[str, Generation] = {}
        while len(results) < len(ids):
            for out in self.step():
                if out.request_id not in texts:
                    continue
                if out.error is not None:
                    for rid in ids:
                        self.abort_request(rid)
                    raise error_from_code(out.error_code, out.error)
                texts[out.request_id].append(out.new_text)
                tokens[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    ids_ = tokens[out.request_id]
                    results[out.request_id] = Generation(
                        request_id=out.request_id, text="".join(texts[out.request_id]), token_ids=ids_,
                        finish_reason=out.finish_reason or "stop", prompt_tokens=out.prompt_tokens,
                        completion_tokens=len(ids_), stats=out.stats, cached_tokens=out.cached_tokens)
        return [results[i] for i in ids]

    def stream(self, prompt: str, sampling: SamplingParams | None = None, fly: FLyConfig | None = None) -> Iterator[str]:
        """Yield text deltas of one prompt as they are decoded."""
        rid = self._new_id("stream")
        self.add_request(rid, self.encode(prompt), sampling or SamplingParams(), fly)
        try:
            done = False
            while not done:
                for out in self.step():
                    if out.request_id == rid:
                        if out.error is not None:
                            raise error_from_code(out.error_code, out.error)
                        if out.new_text:
                            yield out.new_text
                        done = out.finished
        finally:
            self.abort_request(rid)


def _module_device(module: torch.nn.Module | None, default: torch.device) -> torch.device:
    """The device of `module`'s first parameter or buffer (a quantized layer holds only buffers)."""
    tensor = next(itertools.chain(module.parameters(), module.buffers()), None) if module is not None else None
    return tensor.device if tensor is not None else default


def _eos_ids(tokenizer, model) -> frozenset[int]:
    """End-of-sequence ids: the tokenizer's EOS plus the model's generation_config ones."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update([eos] if isinstance(eos, int) else (eos or []))
    return frozenset(ids)
