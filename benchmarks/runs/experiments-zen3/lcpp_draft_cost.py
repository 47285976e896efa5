import time, statistics, sys
from specdec.backends.llamacpp import LlamaCppSession
from specdec import zoo
for name in sys.argv[1:]:
    for th in (2,):
        s = LlamaCppSession(zoo.gguf_path(name), n_ctx=1024, n_threads=th, exact=False)
        toks = list(range(100, 164))
        s.decode(toks, 0, 1)  # warm
        s.remove(0)
        t = []; tb = []
        for rep in range(3):
            s.remove(0)
            t0 = time.perf_counter(); s.decode(toks, 0, 1); tb.append(time.perf_counter() - t0)
            for i in range(20):
                t0 = time.perf_counter(); s.decode([200 + i], 64 + i, 1); t.append(time.perf_counter() - t0)
        print(name, "threads", th, "1-token ms %.1f" % (1000 * statistics.median(t)), "64-token batch ms %.0f" % (1000 * statistics.median(tb)), flush=True)
        del s
