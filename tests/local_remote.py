"""A stand-in for the swarm in unit tests of the gateway's engine: a model run in process.

It has the face of swarm.client.RemoteModel that the engine loop uses: embeddings of many rows in one call, chain
steps started without waiting (here computed at once, each session on its own cache), and the LM head. It counts
those calls, so that tests can count them per tick."""

import copy

import torch
import transformers


class LocalSession:
    """Stands in for swarm.client.InferenceSession: records what would be sent to the servers."""

    servers, group = 1, 0  # a chain of one "server"; the engine loop's pipeline group (unused here)

    def __init__(self, model, max_length):
        self.model, self.max_length = model, max_length
        self.ids, self.sent, self.closed = [], [], False
        self.cache = transformers.DynamicCache()  # keys and values of self.ids, as the servers would hold them

    def step(self, ids, position=None, every_position=False, hidden=None):
        """Token ids in, logits out (what replaying a stored session uses); with `hidden` (1, length, hidden), their
        embeddings, the blocks' outputs out (after the final norm): what the engine loop's steps use."""
        position = len(self.ids) if position is None else position
        if hidden is not None:
            return self._blocks(hidden, ids[0], position)
        with torch.no_grad():
            logits = self.model.lm_head(self._blocks(self.model.get_input_embeddings()(torch.tensor(ids)), ids[0],
                                                     position))
        return logits if every_position else logits[:, -1]

    def _blocks(self, hidden, ids, position):
        self.sent.append(list(ids))
        self.ids = self.ids[:position] + list(ids)
        assert len(self.ids) <= self.max_length
        if position < self.cache.get_seq_length():  # a rewind drops what followed, as the servers do
            self.cache.crop(position - self.cache.get_seq_length())  # (a negative count: tokens to remove)
        with torch.no_grad():
            return self.model.model(inputs_embeds=hidden, past_key_values=self.cache, use_cache=True).last_hidden_state

    def fork(self, length, max_length=None):
        """A session that starts with this one's first `length` positions (the servers would share their pages)."""
        forked = LocalSession(self.model, max_length or self.max_length)
        forked.ids, forked.cache = self.ids[:length], copy.deepcopy(self.cache)
        if length < forked.cache.get_seq_length():
            forked.cache.crop(length - forked.cache.get_seq_length())  # (a negative count: tokens to remove)
        return forked

    def close(self):
        self.closed = True


class LocalRemote:
    head_device = torch.device("cpu")

    def __init__(self, folder):
        self.model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        self.config = self.model.config
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        self.stop_token_ids = frozenset({self.config.eos_token_id, self.tokenizer.eos_token_id})
        self.sessions = []
        self.calls = {"embed": 0, "head": 0, "start_steps": 0}
        self._embedded_ids = []  # the ids of the last embedding call, in the order its steps start

    def session(self, max_length):
        self.sessions.append(LocalSession(self.model, max_length))
        return self.sessions[-1]

    def embed_rows(self, ids, positions):
        self.calls["embed"] += 1
        self._embedded_ids = ids.tolist()
        with torch.no_grad():
            return self.model.get_input_embeddings()(ids)

    def start_steps(self, steps, on_done):
        self.calls["start_steps"] += 1
        offset = 0
        for key, session, hidden, position in steps:
            ids = self._embedded_ids[offset : offset + hidden.shape[1]]
            offset += hidden.shape[1]
            try:
                outputs = session.step([ids], position, hidden=hidden)
            except Exception as error:
                on_done(key, None, error)
            else:
                on_done(key, outputs, None)

    def logits_on_device(self, hidden):
        self.calls["head"] += 1
        with torch.no_grad():
            return self.model.lm_head(hidden).float()
