import json
import string

import pytest
from tiny_models import write_tiny_model

CHARS = string.ascii_letters + string.digits + " .,;:!?'\"-\n()"  # 76 symbols + <unk>: fits the tiny vocab of 96


def write_char_tokenizer(directory) -> None:
    """A character-level tokenizer.json (WordLevel over single characters) so the tiny model can read text."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<unk>"}))
    (directory / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")


@pytest.fixture(scope="session")
def lab_model(tmp_path_factory):
    """The tiny GQA Llama (context 512) with a character tokenizer."""
    d = tmp_path_factory.mktemp("tiny-lab-model")
    write_tiny_model("llama-gqa", d)
    write_char_tokenizer(d)
    return str(d)


@pytest.fixture(scope="session")
def lab_text(tmp_path_factory):
    """About 1,400 characters (= tokens): longer than the tiny model's 512-token context."""
    path = tmp_path_factory.mktemp("lab-text") / "text.txt"
    line = "The grass is green. The sky is blue; 42 birds sing (quietly) in the old oak tree.\n"
    path.write_text(line * 17)
    return str(path)
