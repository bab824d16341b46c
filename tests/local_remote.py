"""A stand-in for the swarm in unit tests of the gateway's engine: a model run in process."""

import torch
import transformers


class LocalSession:
    """Stands in for swarm.client.InferenceSession: records what would be sent to the servers."""

    def __init__(self, model, max_length):
        self.model, self.max_length = model, max_length
        self.ids, self.sent, self.closed = [], [], False
        self.cache = transformers.DynamicCache()  # keys and values of self.ids, as the servers would hold them

    def step(self, ids, position=None, every_position=False):
        position = len(self.ids) if position is None else position
        self.sent.append(list(ids[0]))
        self.ids = self.ids[:position] + list(ids[0])
        assert len(self.ids) <= self.max_length
        if position < self.cache.get_seq_length():  # a rewind drops what followed, as the servers do
            self.cache.crop(position - self.cache.get_seq_length())  # (a negative count: tokens to remove)
        with torch.no_grad():
            logits = self.model(torch.tensor(ids), past_key_values=self.cache, use_cache=True).logits
        return logits if every_position else logits[:, -1]

    def close(self):
        self.closed = True


class LocalRemote:
    def __init__(self, folder):
        self.model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        self.config = self.model.config
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        self.stop_token_ids = frozenset({self.config.eos_token_id, self.tokenizer.eos_token_id})
        self.sessions = []

    def session(self, max_length):
        self.sessions.append(LocalSession(self.model, max_length))
        return self.sessions[-1]
