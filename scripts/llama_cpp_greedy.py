"""Greedy tokens from llama.cpp for `kvserve bench agreement --peer llama.cpp=OUT`.

Runs llama.cpp's own library through the ctypes bindings of the same PyPI sdist the
benchmark docs build it from (llama-cpp-python==0.3.36, its vendored llama.cpp built with
cmake into vendor/llama.cpp/build/bin): each prompt's ids (from `--prompts-out`) are
decoded, then N tokens picked by argmax of the last logits, as transformers' greedy search.

  python scripts/llama_cpp_greedy.py SDIST_DIR MODEL.gguf PROMPTS.json OUT.json [N] [THREADS]
"""

from __future__ import annotations

import json
import os
import sys
import types


def main() -> int:
    sdist, model, prompts_file, out_file = sys.argv[1:5]
    n = int(sys.argv[5]) if len(sys.argv) > 5 else 32
    threads = int(sys.argv[6]) if len(sys.argv) > 6 else 2
    os.environ["LLAMA_CPP_LIB_PATH"] = os.path.join(sdist, "vendor", "llama.cpp", "build", "bin")
    sys.path.insert(0, sdist)
    sys.modules.setdefault("diskcache", types.SimpleNamespace(Cache=object))  # unused here
    import numpy as np
    from llama_cpp import Llama

    with open(prompts_file, encoding="utf-8") as f:
        prompts = json.load(f)
    llm = Llama(model_path=model, n_ctx=2048, n_threads=threads, n_batch=512, verbose=False,
                flash_attn=True)
    out = []
    for ids in prompts:
        llm.reset()
        llm.eval(ids)
        gen: list[int] = []
        for _ in range(n):
            logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
            gen.append(int(logits.argmax()))
            llm.eval([gen[-1]])
        out.append(gen)
    with open(out_file, "w", encoding="utf-8") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
