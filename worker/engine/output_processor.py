"""Output processing: sampled tokens in, stop decisions and `RequestOutput`s out.

Each sequence carries an incremental detokenizer; a new token is fed to it, vLLM's stop rules are
applied (EOS, stop token ids, stop strings, max_tokens, max_model_len, a completed grammar), and a
request's output for a step holds what each of its samples added since the last one handed out (token
ids, text, logprobs with the tokens' texts and bytes, and for a request with tools the content and
tool-call deltas its parser found).
"""

from __future__ import annotations

from typing import Any

from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.outputs import CompletionOutput, RequestOutput
from worker.engine.request import Request, SeqStatus, Sequence
from worker.engine.sampler import SamplerOutput
from worker.engine.token_text import TokenTexts, for_tokenizer

_RUNNING = (SeqStatus.WAITING, SeqStatus.RUNNING)


class OutputProcessor:
    def __init__(self, tokenizer: Any, *, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.texts: TokenTexts | None = for_tokenizer(tokenizer) if tokenizer is not None else None

    def attach_detokenizer(self, seq: Sequence) -> None:
        """The sequence's detokenizer, and its tool-call parser when the request has tools."""
        req = seq.request
        seq.detokenizer = IncrementalDetokenizer.from_sampling_params(
            self.tokenizer, req.prompt_token_ids, req.sampling_params
        )
        if req.tool_parser is not None:
            seq.tool_parser = req.tool_parser(req.request_id, seq.index)

    def append_sampled(
        self, seqs: list[Sequence], result: SamplerOutput, now: float, skip: frozenset[int] = frozenset()
    ) -> list[SeqStatus | None]:
        """Append each row's sampled token (and logprobs) to its sequence; per row, the status it
        finishes with, or None if it goes on. Rows in `skip` (refused by their grammar) are left out."""
        tokens = result.token_ids.tolist()
        lp = top_ids = top_lp = None
        if result.logprobs is not None:
            lp = result.logprobs.tolist()
            top_ids = result.top_token_ids.tolist() if result.top_token_ids is not None else None
            top_lp = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        statuses = []
        check_stop = self.check_stop
        for r, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            if skip and r in skip:
                statuses.append(None)
                continue
            seq.token_ids.append(token)
            m = seq.request.metrics
            if m.first_token is None or seq.index or m.last_token is None:
                _record_token_time(seq, now)
            else:  # sample 0 of a request past its first token (the common case, inlined)
                m.inter_token_latencies.append(now - m.last_token)
                m.last_token = now
            if lp is None:
                statuses.append(check_stop(seq, token))
                continue
            k = seq.request.sampling_params.logprobs
            if k is not None:
                seq.logprobs.append(lp[r])
                top = list(zip(top_ids[r][:k], top_lp[r][:k], strict=True)) if k and top_ids else []
                seq.top_logprobs.append(top)
                if self.texts is not None:
                    self._add_texts(seq, token, top)
            statuses.append(self.check_stop(seq, token))
        return statuses

    def _add_texts(self, seq: Sequence, token: int, top: list[tuple[int, float]]) -> None:
        """The text and bytes of the sampled token and of its top alternatives (`token_text`)."""
        assert self.texts is not None
        text, data, seq.held_bytes, top_texts, top_bytes = self.texts.step(seq.held_bytes, token, top)
        seq.token_texts.append(text)
        seq.token_bytes.append(data)
        seq.top_texts.append(top_texts)
        seq.top_bytes.append(top_bytes)

    def check_stop(self, seq: Sequence, token: int) -> SeqStatus | None:
        """Feed the newest token to the detokenizer (unless it is the stop token) and apply vLLM's stops."""
        p = seq.request.sampling_params
        n_out = len(seq.token_ids) - seq.num_prompt_tokens
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return SeqStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return SeqStatus.FINISHED_STOPPED
        seq.pending_text += seq.detokenizer.update(token)
        if seq.detokenizer.stopped:
            seq.stop_reason = seq.detokenizer.stop_reason
            return SeqStatus.FINISHED_STOPPED
        if seq.matcher is not None and seq.matcher.is_terminated():  # the grammar took its stop token
            return SeqStatus.FINISHED_STOPPED
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return SeqStatus.FINISHED_LENGTH
        if len(seq.token_ids) >= self.max_model_len:
            return SeqStatus.FINISHED_LENGTH
        return None

    def replay(self, seq: Sequence, delivered: list[int]) -> SeqStatus | None:
        """Tokens a previous worker already delivered: appended and fed to the detokenizer (so its held-back
        text and stop-string state are what the first worker had), never handed out again. Returns the
        status the sample had stopped with, if it had."""
        status = None
        texts = self.texts if seq.request.sampling_params.logprobs is not None else None
        for token in delivered:
            seq.token_ids.append(token)
            status = self.check_stop(seq, token)
            if texts is not None:  # the bytes of a character split across the handover stay held
                seq.held_bytes = texts.sampled(seq.held_bytes, token)[2]
        if seq.tool_parser is not None:  # its deltas were delivered with those tokens
            seq.tool_parser.feed(seq.pending_text)
        seq.pending_text = ""
        seq.num_emitted = seq.logprob_offset = seq.num_output_tokens
        return status

    @staticmethod
    def flush(seq: Sequence) -> None:
        """The sequence finished: whatever text the detokenizer held back is now final."""
        if seq.detokenizer:
            seq.pending_text += seq.detokenizer.flush()

    @staticmethod
    def make_output(req: Request, prev: RequestOutput | None) -> RequestOutput:
        """The request's output for this step: what each sample added since it was last handed out, on
        top of `prev` (the output already built for it this step, if any)."""
        want_lp = req.sampling_params.logprobs is not None
        completions = []
        finished = True
        for seq in req.seqs:
            start = seq.num_emitted
            output_ids = seq.token_ids[seq.num_prompt_tokens :]
            new_ids = output_ids[start:]
            seq.num_emitted = len(output_ids)
            delta, seq.pending_text = seq.pending_text, ""
            old = prev.outputs[seq.index] if prev is not None and seq.index < len(prev.outputs) else None
            if seq.status in _RUNNING:
                finished = False
                reason = None
            else:
                reason = seq.finish_reason
            out = CompletionOutput(
                index=seq.index,
                text=seq.detokenizer.output_text if seq.detokenizer else "",
                token_ids=output_ids,
                finish_reason=reason,
                stop_reason=seq.stop_reason,
                delta_token_ids=old.delta_token_ids + new_ids if old else new_ids,
                delta_text=old.delta_text + delta if old else delta,
            )
            if want_lp:  # tokens a previous worker delivered (resume) have none
                lp_start = max(start - seq.logprob_offset, 0)
                out.logprobs, out.top_logprobs = list(seq.logprobs), list(seq.top_logprobs)
                out.delta_logprobs = (old.delta_logprobs if old else []) + seq.logprobs[lp_start:]
                out.delta_top_logprobs = (old.delta_top_logprobs if old else []) + seq.top_logprobs[lp_start:]
                if len(seq.token_texts) == len(seq.logprobs):  # the tokenizer gave texts
                    _texts(seq, lp_start, out, old)
            if seq.tool_parser is not None:
                _parse_tools(seq, delta, out, old)
            completions.append(out)
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=req.metrics,
            error=req.error,
            error_code=req.error_code,
        )


def _texts(seq: Sequence, lp_start: int, out: CompletionOutput, old: CompletionOutput | None) -> None:
    """The tokens' texts and bytes: what this step added (on top of `old`), and, once the sample
    finished, all of them (not copied at every step: the deltas are what a stream needs)."""
    if seq.finished:
        out.token_texts, out.token_bytes = seq.token_texts, seq.token_bytes
        out.top_token_texts, out.top_token_bytes = seq.top_texts, seq.top_bytes
    if old is not None and old.delta_token_texts is not None:
        out.delta_token_texts = old.delta_token_texts + seq.token_texts[lp_start:]
        out.delta_token_bytes = (old.delta_token_bytes or []) + seq.token_bytes[lp_start:]
        out.delta_top_token_texts = (old.delta_top_token_texts or []) + seq.top_texts[lp_start:]
        out.delta_top_token_bytes = (old.delta_top_token_bytes or []) + seq.top_bytes[lp_start:]
    else:
        out.delta_token_texts = seq.token_texts[lp_start:]
        out.delta_token_bytes = seq.token_bytes[lp_start:]
        out.delta_top_token_texts = seq.top_texts[lp_start:]
        out.delta_top_token_bytes = seq.top_bytes[lp_start:]


def _parse_tools(seq: Sequence, delta: str, out: CompletionOutput, old: CompletionOutput | None) -> None:
    """Feed the step's text to the sample's tool-call parser (and flush it once the sample ended)."""
    parser = seq.tool_parser
    assert parser is not None
    parsed = parser.feed(delta)
    if seq.finished:
        tail = parser.finish()
        parsed.content += tail.content
    out.content = parser.content
    out.tool_calls = parser.tool_calls() or None
    out.delta_content = ((old.delta_content or "") if old else "") + parsed.content
    out.delta_tool_calls = (old.delta_tool_calls if old else []) + parsed.tool_calls


def _record_token_time(seq: Sequence, now: float) -> None:
    """First-token time, and inter-token latencies of sample 0."""
    m = seq.request.metrics
    if m.first_token is None:
        m.first_token = now
    elif seq.index == 0 and m.last_token is not None:
        m.inter_token_latencies.append(now - m.last_token)
    if seq.index == 0:
        m.last_token = now
