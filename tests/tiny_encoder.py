"""A tiny random-weight BERT saved as a sentence-transformers folder, laid out as the hub's models are (e.g.
all-MiniLM-L6-v2: modules.json naming Transformer, Pooling and Normalize, sentence_bert_config.json,
1_Pooling/config.json), with a small WordPiece tokenizer trained here: nothing is downloaded. Written without
importing sentence-transformers, so that the shared gateway fixture can serve one for almost nothing."""

from __future__ import annotations

import json
from pathlib import Path

from tiny_model import CORPUS

HIDDEN = 32
MAX_SEQ_LENGTH = 24  # short, so that a test can go past it with a few words
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def build_wordpiece_tokenizer(vocab_size: int = 300):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS))
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                   model_max_length=MAX_SEQ_LENGTH)


def build_tiny_encoder(folder: Path, normalize: bool = True, seed: int = 0) -> Path:
    """Save the encoder into `folder` (its name is the name a gateway serves it under): mean pooling, and a
    Normalize module if `normalize`."""
    import torch
    from transformers import BertConfig, BertModel

    tokenizer = build_wordpiece_tokenizer()
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id)
    BertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    modules = [("", "Transformer"), ("1_Pooling", "Pooling")] + ([("2_Normalize", "Normalize")] if normalize else [])
    _write(folder / "modules.json", [{"idx": index, "name": str(index), "path": path,
                                      "type": f"sentence_transformers.models.{kind}"}
                                     for index, (path, kind) in enumerate(modules)])
    _write(folder / "sentence_bert_config.json", {"max_seq_length": MAX_SEQ_LENGTH, "do_lower_case": False})
    _write(folder / "1_Pooling" / "config.json", {"word_embedding_dimension": HIDDEN, "pooling_mode_mean_tokens": True,
                                                  "pooling_mode_cls_token": False, "pooling_mode_max_tokens": False})
    if normalize:
        (folder / "2_Normalize").mkdir()
    return folder


def _write(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2))
