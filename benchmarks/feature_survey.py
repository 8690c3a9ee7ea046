"""Which features of the embedded model make the best Banking77 head: a survey (#35).

    python -m benchmarks.feature_survey . cuda benchmarks/results [--limit N] [--bs 128]

Run on a GPU (2026-12-04, one H200: 476 s; on this project's 2-core CPU machine the whole
prompts of 13,083 rows would take hours: each is re-encoded in full, as research, not
through the cache). The result, benchmarks/results/feature_survey.json, chose the shipped
head's features (mean pooling over layers 6,12,18,24,30) by training-row cross-validation.
Prompts: ``task`` (the banking77_head task's prompt), ``eol`` ('This sentence : "..." means
in one word:"') and ``plain`` (the text alone); pooling ``last`` (the last position) or
``mean`` (over the text's tokens); layers are indices into the model's hidden states.

Features by plain full re-encoding (research only: no cache); multinomial logistic
regression in torch (standardised features, L2 chosen by 3-fold CV on the training rows
only). Reports, per feature set: train-CV accuracy (what a choice may use) and test
accuracy (reported, never used to choose), for the full train split and 10 rows per intent
(seed 77 per label, as benchmarks.heads).
"""
import csv, json, os, random, sys, time

project, device, out_dir = sys.argv[1:4]
limit = int(sys.argv[sys.argv.index("--limit") + 1]) if "--limit" in sys.argv else None
BS = int(sys.argv[sys.argv.index("--bs") + 1]) if "--bs" in sys.argv else 128
sys.path.insert(0, project)
import torch
import torch.nn.functional as F
from beam_prefix import TaskSpec
from beam_prefix.model import load_model
from beam_prefix.tasks.prompt import PromptLayout

T0 = time.time()
DATA = os.path.join(project, "pipelines", "data", "banking77")


def rows(name):
    with open(os.path.join(DATA, name), newline="", encoding="utf-8") as f:
        return [(r["text"], r["category"]) for r in csv.DictReader(f)]


train, test = rows("train.csv"), rows("test.csv")
labels = sorted({l for _, l in train})
if limit:
    random.Random(0).shuffle(train); random.Random(0).shuffle(test)
    train, test = train[:limit], test[:limit // 3]
lab = {l: i for i, l in enumerate(labels)}
by = {}
for r in train:
    by.setdefault(r[1], []).append(r)
few = [r for l in sorted(by) for r in random.Random(77).sample(by[l], min(10, len(by[l])))]

loaded = load_model("embedded", device=device, prepack=False)
model, tok = loaded.model, loaded.tokenizer
task = TaskSpec.from_yaml(os.path.join(project, "pipelines", "tasks", "banking77_head.yaml"))
layout = PromptLayout.build(task.replace(head=None, scoring="auto"), tok)
LAYERS = [3, 6, 9, 12, 15, 18, 21, 24, 27, 30]


def prompt_ids(kind, text):
    """(ids, first text token, end of text tokens)."""
    if kind == "task" and "--fast" in sys.argv:  # local check of the script only
        kind = "eol"
    if kind == "task":
        ids, enc = layout.encode_full(text)
        p = len(ids) - len(enc.suffix_ids)
        return list(ids), p, p + enc.text_tokens
    if kind == "eol":
        a = tok('This sentence : "', add_special_tokens=False)["input_ids"]
        b = tok(text.strip(), add_special_tokens=False)["input_ids"]
        c = tok('" means in one word:"', add_special_tokens=False)["input_ids"]
        return a + b + c, len(a), len(a) + len(b)
    b = tok(text.strip(), add_special_tokens=False)["input_ids"]
    return b, 0, len(b)


@torch.no_grad()
def features(kind, texts, bs=None):
    bs = bs or BS
    """{('last'|'mean', layer): [N, H]} on the device (fp32)."""
    out = {}
    enc = [prompt_ids(kind, t) for t in texts]
    for s in range(0, len(enc), bs):
        chunk = enc[s:s + bs]
        L = max(len(i) for i, _, _ in chunk)
        ids = torch.zeros(len(chunk), L, dtype=torch.long, device=device)
        mask = torch.zeros(len(chunk), L, dtype=torch.long, device=device)
        for r, (i, _, _) in enumerate(chunk):
            ids[r, :len(i)] = torch.tensor(i, device=device); mask[r, :len(i)] = 1
        hs = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        last = torch.tensor([len(i) - 1 for i, _, _ in chunk], device=device)
        span = torch.zeros(len(chunk), L, device=device)
        for r, (_, a, b) in enumerate(chunk):
            span[r, a:b] = 1
        span = span / span.sum(1, keepdim=True).clamp(min=1)
        for layer in LAYERS:
            h = hs[layer].float()
            out.setdefault(("last", layer), []).append(h[torch.arange(len(chunk)), last])
            out.setdefault(("mean", layer), []).append(torch.einsum("bl,blh->bh", span, h))
    return {k: torch.cat(v) for k, v in out.items()}


def fit_lr(X, y, l2, iters=100):
    mu, sd = X.mean(0), X.std(0).clamp(min=1e-6)
    Z = (X - mu) / sd
    W = torch.zeros(X.shape[1], len(labels), device=device, requires_grad=True)
    b = torch.zeros(len(labels), device=device, requires_grad=True)
    opt = torch.optim.LBFGS([W, b], lr=1, max_iter=iters, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(Z @ W + b, y) + l2 * (W * W).sum() / 2
        loss.backward()
        return loss
    opt.step(closure)
    W, b = W.detach(), b.detach()
    return lambda Xt: ((Xt - mu) / sd) @ W + b


L2S = (1e-4, 1e-3, 1e-2)


def cv_choose(X, y, folds=3):
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(y), generator=g).to(device)
    best = None
    for l2 in L2S:
        correct = 0
        for k in range(folds):
            te = perm[k::folds]; tr = torch.cat([perm[j::folds] for j in range(folds) if j != k])
            f = fit_lr(X[tr], y[tr], l2)
            correct += int((f(X[te]).argmax(1) == y[te]).sum())
        acc = correct / len(y)
        if best is None or acc > best[0]:
            best = (acc, l2)
    return best


def evaluate(name, Xtr, ytr, Xte, yte, results, regime):
    cv, l2 = cv_choose(Xtr, ytr)
    f = fit_lr(Xtr, ytr, l2)
    acc = float((f(Xte).argmax(1) == yte).float().mean())
    results.setdefault(regime, {})[name] = {"cv": round(cv, 4), "test": round(acc, 4), "l2": l2,
                                           "dim": int(Xtr.shape[1])}
    print(regime, name, results[regime][name], f"{time.time() - T0:.0f}s", flush=True)
    return f


results = {"device": torch.cuda.get_device_name(0) if device.startswith("cuda") else device,
           "n_train": len(train), "n_test": len(test), "n_few": len(few)}
texts_tr = [t for t, _ in train]; texts_te = [t for t, _ in test]
y_tr = torch.tensor([lab[l] for _, l in train], device=device)
y_te = torch.tensor([lab[l] for _, l in test], device=device)
few_idx = torch.tensor([texts_tr.index(t) for t, _ in few], device=device)

feats = {}
for kind in ("task", "eol", "plain"):
    t = time.time()
    tr, te = features(kind, texts_tr), features(kind, texts_te)
    feats[kind] = (tr, te)
    print(kind, "features", f"{time.time() - t:.0f}s", flush=True)

sets = {}
for kind in ("task", "eol", "plain"):
    for pool in ("last", "mean"):
        for layer in (6, 12, 18, 24, 30):
            sets[f"{kind}/{pool}{layer}"] = [(kind, pool, layer)]
sets["task/last30+last12 (shipped)"] = [("task", "last", 30), ("task", "last", 12)]
for kind in ("task", "eol", "plain"):
    sets[f"{kind}/mean12+mean18+mean24"] = [(kind, "mean", 12), (kind, "mean", 18), (kind, "mean", 24)]
    sets[f"{kind}/mean6..30 (5)"] = [(kind, "mean", l) for l in (6, 12, 18, 24, 30)]
    sets[f"{kind}/last30+mean12+mean18"] = [(kind, "last", 30), (kind, "mean", 12), (kind, "mean", 18)]
sets["task/last12+mean12+eol/last30"] = [("task", "last", 12), ("task", "mean", 12), ("eol", "last", 30)]


def X(spec, part):
    return torch.cat([feats[k][part][(p, l)] for k, p, l in spec], 1)


fits = {}
for name, spec in sets.items():
    Xtr, Xte = X(spec, 0), X(spec, 1)
    evaluate(name, Xtr[few_idx], y_tr[few_idx], Xte, y_te, results, "few")
for regime in ("few",):
    pass
# full train: the best 6 by few-shot CV plus the shipped one
ranked = sorted(results["few"], key=lambda n: -results["few"][n]["cv"])[:6]
for name in dict.fromkeys(ranked + ["task/last30+last12 (shipped)"]):
    evaluate(name, X(sets[name], 0), y_tr, X(sets[name], 1), y_te, results, "full")

# lexical evidence: TF-IDF (word 1-2 + char 2-5), alone and with the LM features (log-probs added)
from sklearn.feature_extraction.text import TfidfVectorizer
from scipy.sparse import hstack
w = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=1)
c = TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 5), sublinear_tf=True, min_df=2, max_features=60000)


def tfidf(fit_texts, texts):
    w.fit(fit_texts); c.fit(fit_texts)
    return torch.tensor(hstack([w.transform(texts), c.transform(texts)]).toarray(), device=device, dtype=torch.float32)


def lr_plain(X, y, l2, iters=100):  # TF-IDF rows are l2-normalised already: no standardising
    W = torch.zeros(X.shape[1], len(labels), device=device, requires_grad=True)
    b = torch.zeros(len(labels), device=device, requires_grad=True)
    opt = torch.optim.LBFGS([W, b], lr=1, max_iter=iters, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad(); loss = F.cross_entropy(X @ W + b, y) + l2 * (W * W).sum() / 2; loss.backward(); return loss
    opt.step(closure)
    return lambda Xt: Xt @ W.detach() + b.detach()


for regime, idx in (("few", few_idx), ("full", torch.arange(len(y_tr), device=device))):
    fit_texts = [texts_tr[i] for i in idx.tolist()]
    Ttr, Tte = tfidf(fit_texts, fit_texts), tfidf(fit_texts, texts_te)
    ytr = y_tr[idx]
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(ytr), generator=g).to(device)
    best_lm = max((n for n in results[regime]), key=lambda n: results[regime][n]["cv"])
    Ltr, Lte = X(sets[best_lm], 0)[idx], X(sets[best_lm], 1)
    l2_lm = results[regime][best_lm]["l2"]
    # choose the TF-IDF L2 and the mixing weight by 3-fold CV on the training rows
    best = None
    ALPHAS = (0.0, 0.5, 1.0, 2.0, 1e9)
    for l2t in (1e-4, 1e-3):
        correct = dict.fromkeys(ALPHAS, 0)
        for k in range(3):
            te = perm[k::3]; tr = torch.cat([perm[j::3] for j in range(3) if j != k])
            lt = F.log_softmax(lr_plain(Ttr[tr], ytr[tr], l2t)(Ttr[te]), 1)
            ll = F.log_softmax(fit_lr(Ltr[tr], ytr[tr], l2_lm)(Ltr[te]), 1)
            for alpha in ALPHAS:
                mix = lt if alpha >= 1e9 else ll + alpha * lt
                correct[alpha] += int((mix.argmax(1) == ytr[te]).sum())
        for alpha in ALPHAS:
            acc = correct[alpha] / len(ytr)
            results.setdefault(regime + "_hybrid_cv", {})[f"l2={l2t} alpha={alpha}"] = round(acc, 4)
            if best is None or acc > best[0]:
                best = (acc, l2t, alpha)
    acc, l2t, alpha = best
    ft = lr_plain(Ttr, ytr, l2t)
    fl = fit_lr(Ltr, ytr, l2_lm)
    tf_only = float((ft(Tte).argmax(1) == y_te).float().mean())
    mix = F.log_softmax(fl(Lte), 1) + (alpha * F.log_softmax(ft(Tte), 1) if alpha < 1e9 else 0)
    if alpha >= 1e9:
        mix = ft(Tte)
    results[regime]["tfidf alone"] = {"test": round(tf_only, 4), "l2": l2t}
    results[regime][f"hybrid: {best_lm} + tfidf"] = {"cv": round(acc, 4), "test": round(float(
        (mix.argmax(1) == y_te).float().mean()), 4), "alpha": alpha, "l2_tfidf": l2t}
    print(regime, "tfidf", tf_only, "hybrid", results[regime][f"hybrid: {best_lm} + tfidf"], flush=True)

results["seconds"] = round(time.time() - T0, 1)
os.makedirs(out_dir, exist_ok=True)
with open(os.path.join(out_dir, "exp35.json"), "w") as f:
    json.dump(results, f, indent=1)
print("done", results["seconds"])
