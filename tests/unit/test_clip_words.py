"""Issue 37, item 7: the one line a rank prints for gloo's error after another rank died cut
the message mid-word at 120 characters; it is cut at a word's end now, and says it was cut."""

from __future__ import annotations

from cfrun.rank.install import clip_words

GLOO = ("Connection closed by peer [127.0.0.1]:29500 while reading the header of a message "
        "from rank 1 of the gloo process group, after the previous collective")


def test_a_long_message_is_cut_at_a_words_end_and_says_so():
    cut = clip_words(GLOO, 120)
    assert len(cut) <= 120 and cut.endswith(" ...")
    kept = cut.removesuffix(" ...")
    assert GLOO.startswith(kept) and GLOO[len(kept)] == " "  # a whole word last


def test_a_short_message_is_kept_whole_and_a_long_word_is_cut_inside():
    assert clip_words("  Connection reset by peer ", 120) == "Connection reset by peer"
    assert clip_words("x" * 200, 20) == "x" * 16 + " ..."
