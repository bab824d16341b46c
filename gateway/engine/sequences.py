"""One request's reply inside its model's engine loop (loop.py), and the one writer of a session's token history.

A session's history is the token ids its servers' caches hold; its pending tokens were chosen (shown to the client)
but not sent yet. While a reply runs, only its Sequence, on the loop's thread, changes them; between replies the
functions at the end of this module do (rewinding for another choice or a regenerate, forgetting a prefix).

A step sends the feed (the pending token, then any new input) and, when the loop lets it draft, a guess of the next
few tokens (speculation.py); its outputs come back some ticks later. The loop then asks for the positions whose
logits it needs (`head_rows`), samples them, and hands the logits back (`take_plain` for a step without a draft,
`take_verified` with one): the sequence emits its tokens to its output stream and either ends or has its next feed.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Optional

import torch

from gateway.engine.metrics import ACCEPTED_DRAFT_TOKENS, DRAFT_TOKENS
from gateway.engine.outputs import OutputStream, Token, TokenLogprob
from gateway.engine.sampler import Sampler
from gateway.engine.speculation import Pacing, prompt_lookup


class Sequence:
    def __init__(self, session, feed: list[int], budget: int, sampler: Sampler, constraint, stop_ids: set[int],
                 logprobs: Optional[int], pacing: Optional[Pacing] = None, guesses=None):
        """`budget`: how many tokens the reply may have (0: only take the feed into the servers' caches);
        `pacing` None: never drafts; `guesses`: a draft model's (drafts.ReplyDrafts), where prompt lookup has none."""
        self.session, self.feed, self.budget, self.sampler = session, list(feed), budget, sampler
        self.constraint, self.stop_ids, self.logprobs = constraint, stop_ids, logprobs
        self.pacing, self.guesses = pacing, guesses
        self.start = session.history + self.feed  # the reply's first token follows these
        self.generated: list[int] = []
        self.outbox: list[Token] = []  # tokens taken this tick, not yet handed to the reader (publish)
        self.stream = OutputStream()
        self.draft: list[int] = []
        self.in_flight = False
        self.done = False
        self.aborted = False  # its reader (or the session's close) has ended it
        self.abort_at: Optional[int] = None  # the reader ended the reply after this many tokens
        self.settled = threading.Event()  # set once the session's history is final (the reply is over)
        self.serial = 0  # its number in its engine loop: which group of the pipeline it travels in (loop.py)
        self._sent_at, self._began = 0, 0.0

    # ---- sending a step

    def tokens_to_send(self, may_draft: bool) -> list[int]:
        """The feed, and a draft after it where the loop lets this sequence draft and a guess pays."""
        self.draft = self._draft() if may_draft else []
        return self.feed + self.draft

    @property
    def position(self) -> int:
        return len(self.session.history)

    def sent(self) -> None:
        self.in_flight, self._sent_at, self._began = True, len(self.session.history), time.perf_counter()

    def landed(self) -> None:
        """The step's outputs came back: the servers hold what it sent."""
        self.in_flight = False
        self.session.history.extend(self.feed + self.draft)
        self.session.last_used = time.monotonic()
        if self.pacing is not None and len(self.feed) == 1:  # a prompt's step would skew the pacing
            self.pacing.costs.observed(1 + len(self.draft), time.perf_counter() - self._began)

    def head_rows(self) -> int:
        """How many of the step's last positions need logits: none for a feed alone, else one, or every position
        from the feed's last through the draft's."""
        return 0 if self.budget == 0 else 1 + len(self.draft)

    # ---- taking the sampled tokens

    def allowed(self) -> Optional[torch.Tensor]:
        return self.constraint.allowed() if self.constraint is not None else None

    def take_plain(self, token: int, logits: torch.Tensor) -> None:
        """The one token sampled after a step with no draft (the sampler has it in its state already)."""
        if self.pacing is not None:
            self.pacing.undrafted()
        if token < 0:
            raise ValueError("no token can be chosen: the allowed mask and logit_bias exclude every token")
        self._emit([(token, logits, self._advance_grammar(token))])

    def take_verified(self, rows: torch.Tensor) -> None:
        """Rows (1 + len(draft), vocab): logits after the feed's last token and after each draft token. Each token
        is chosen as plain decoding chooses it; the draft stands up to its first wrong guess."""
        emitted, kept = [], 0
        room = self.budget - len(self.generated)
        for index, guess in enumerate([*self.draft, None]):
            allowed = self.allowed()
            token, right = self.sampler.verify(rows[index], guess, allowed) if guess is not None else (
                self.sampler(rows[index], allowed), False)
            emitted.append((token, rows[index], self._advance_grammar(token)))
            kept += right
            if not right or token in self.stop_ids or emitted[-1][2] or len(emitted) == room:
                break
        self.pacing.drafted(len(self.draft), kept)
        DRAFT_TOKENS.labels(self.session.model.name).inc(len(self.draft))
        ACCEPTED_DRAFT_TOKENS.labels(self.session.model.name).inc(kept)
        # the servers hold feed + draft; what they keep is the feed and the draft tokens emitted before the last
        del self.session.history[self._sent_at + len(self.feed) + len(emitted) - 1 :]
        self._emit(emitted)

    def _advance_grammar(self, token: int) -> bool:
        """Take the token into the grammar's state; whether the grammar is finished with it."""
        if self.constraint is None or token in self.stop_ids:
            return False
        self.constraint.accept(token)
        return self.constraint.is_finished()

    def _emit(self, emitted: list[tuple[int, torch.Tensor, bool]]) -> None:
        for token, logits, completes_grammar in emitted:
            self.generated.append(token)
            stop_token = token in self.stop_ids
            finish = "stop" if stop_token or completes_grammar else (
                "length" if len(self.generated) == self.budget else None)
            logprob = token_logprob(logits, token, self.logprobs) if self.logprobs is not None else None
            self.outbox.append(Token(token, logprob, finish, stop_token))
            if finish is not None:
                self.settle(len(self.generated))
                return
        self.feed = [self.generated[-1]]

    def publish(self) -> None:
        """Hand the tokens taken this tick to the reader: the loop does it once the next steps are on their way,
        so that readers waking up (to detokenize and write) never hold up a step."""
        if self.outbox:
            self.stream.put(*self.outbox)
            self.outbox = []

    # ---- ending

    def settle(self, kept: int) -> None:
        """The reply ends after its first `kept` tokens: the session holds the prompt and them (the last one
        pending, sent with the next step: the servers drop whatever they hold past it then)."""
        if self.budget == 0:
            restore(self.session, self.start, [])
        else:
            set_tokens(self.session, self.start + self.generated[:kept])
        self.done = True
        self.settled.set()

    def wait(self) -> None:
        """Until the reply is over; then its failure, if it failed, is raised here."""
        self.settled.wait()
        if self.stream.error is not None:
            raise self.stream.error

    def _draft(self) -> list[int]:
        if self.pacing is None or len(self.feed) != 1 or self.budget == 0:
            return []
        session = self.session
        space = session.max_length - len(session.history) - len(self.feed)  # positions the servers may take
        most = min(self.pacing.length(), self.budget - len(self.generated) - 1, space)
        context = session.history + self.feed
        draft = prompt_lookup(context, most)
        if not draft and self.guesses is not None:
            draft = self.guesses.propose(context, most)
        vocab = session.model.vocab_size
        draft = list(itertools.takewhile(lambda token: token < vocab, draft))  # ids past the LM head end it
        if draft and self.constraint is not None:
            draft = draft[: self.constraint.valid_prefix(draft)]
        return draft


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The token's log-probability and the `top` likeliest: a few numbers to the host, never the vocabulary."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (vocab,)
    best = torch.topk(logprobs, top) if top else None
    pairs = tuple(zip(best.indices.tolist(), best.values.tolist())) if best is not None else ()
    return TokenLogprob(token, float(logprobs[token]), pairs)


# ---- a session's tokens between replies


def set_tokens(session, tokens: list[int]) -> None:
    """The session holds `tokens`: all but the last in its servers' caches, the last one pending."""
    session.history, session.pending = tokens[:-1], tokens[-1:]


def rewind(session, length: int) -> None:
    """Forget everything after the first `length` tokens (another choice for the same prompt, a regenerate): the
    servers overwrite their caches from there, so the prompt is not computed again."""
    set_tokens(session, (session.history + session.pending)[: max(length, 0)])


def forget_after(session, cached: int) -> None:
    """Keep only the first `cached` tokens, all in the servers' caches, none pending (a prefix to continue)."""
    session.history, session.pending = session.history[:cached], []


def restore(session, history: list[int], pending: list[int]) -> None:
    """A stored session's tokens, once its replay has put `history` into the servers' caches."""
    session.history, session.pending = list(history), list(pending)
