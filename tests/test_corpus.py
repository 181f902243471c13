"""The corpus: markdown plays -> `SPEAKER:` text, and the shipped held-out plays."""

import hashlib
import json

from minivllm.model.checkpoint import WEIGHTS_DIR
from minivllm.training import corpus

MARKDOWN = """# Macbeth

## ACT I

### SCENE I. A desert place.

_Thunder and lightning. Enter three Witches_

**First Witch**  
When shall we three meet again  
In thunder, lightning, or in rain?

**Second Witch**  
_\\[Aside]_  
When the hurlyburly's done,  
\\--When the battle's lost and won.

_Exeunt_

### SCENE II. A camp near Forres.

_Alarum within. Enter DUNCAN,
meeting a bleeding Sergeant_

**DUNCAN**  
What bloody man is that?
"""  # noqa: W291 -- the two trailing spaces are markdown line breaks, as in the real plays


def test_parse_play_keeps_speeches_and_drops_directions():
    play = corpus.parse_play("macbeth", MARKDOWN)
    assert play.title == "Macbeth"
    assert play.scenes == (
        "First Witch:\nWhen shall we three meet again\nIn thunder, lightning, or in rain?\n\n"
        "Second Witch:\nWhen the hurlyburly's done,\n--When the battle's lost and won.\n\n",
        "DUNCAN:\nWhat bloody man is that?\n\n",
    )


def test_shipped_validation_text_is_the_held_out_plays_of_the_model_card():
    text = corpus.shipped_validation_text()
    card = json.loads((WEIGHTS_DIR / "target" / "training.json").read_text())
    assert len(text.encode()) == card["validation_bytes"]
    assert hashlib.sha256(text.encode()).hexdigest() == card["validation_sha256"]
    assert "Exeunt" not in text and "**" not in text
