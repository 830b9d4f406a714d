"""Time to first token of a chat's next turn with a ~1000-token history: the same Model (prefix reuse) against
reset() before the turn (no reuse). Both give the same tokens, bit for bit.
Usage: python tools/ttft_returning_chat.py [model] [history_tokens]"""
import sys
import time

import edgellm


def main(name="smollm2-135m", history=1000):
    m = edgellm.load(name, n_ctx=2048)
    turns, n = [], 0
    for i in range(200):
        turns += [{"role": "user", "content": f"Question {i}: tell me one fact about the number {i * 7}."},
                  {"role": "assistant", "content": f"The number {i * 7} is {'even' if i % 2 == 0 else 'odd'}, "
                                                   f"and {i * 7} plus one is {i * 7 + 1}."}]
        n = len(m.chat_prompt_ids(turns))
        if n >= history:
            break
    first = turns[:-1]  # the previous turn: the history without the last reply, which the model generates now
    rows = []
    for reuse in (True, False, True, False):
        m.reset()
        reply = m.complete(m.chat_prompt_ids(first), max_tokens=16, ignore_eos=True)
        follow = first + [{"role": "assistant", "content": m.detokenize(reply.tokens)},
                          {"role": "user", "content": "And the next one?"}]
        if not reuse:
            m.reset()
        t0 = time.perf_counter()
        c = m.complete(m.chat_prompt_ids(follow), max_tokens=1)
        rows.append((reuse, time.perf_counter() - t0, m.timings.prompt_tokens, m.timings.reused_tokens, c.tokens))
    for reuse, s, n_prompt, n_reused, tokens in rows:
        print(f"{'reuse' if reuse else 'fresh'}: first token {1e3 * s:.0f} ms, prompt {n_prompt} tokens, "
              f"reused {n_reused}, token {tokens}")


if __name__ == "__main__":
    main(*(sys.argv[1:2] or ["smollm2-135m"]), *(int(a) for a in sys.argv[2:3]))
