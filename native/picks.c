/*
 * The workers' picks over the KV block index, one native call per routing decision:
 * kv_cache_aware (prefix depth by a jump walk - load_weight x load, load cap, fleet-wide tie
 * rotation, routed-block tracking past the winner's event depth with claim-race resolution),
 * conversation sessions (explicit, sticky by CAS; implicit, by routed prefix) and the read-only
 * match. A pick reads the configuration and
 * every worker row from the control segment and writes only: keys it inserts (CAS), routed bits
 * and stamps (fetch_or / relaxed store), the role's tie ticket, and the caller's own row.
 */
#include "index.h"

#include <math.h>

/* ---- workers: picks --------------------------------------------------------------------- */

/* Prefix depth of every server in `active` by the linear walk (match, implicit conversations):
 * depth[s] = leading hashes whose mask (routed, plus event for blocks) has s's bit; drop[s] = the
 * full mask of the block where s dropped out. Stops once no server is left (design section
 * 4.3). pick_kv uses the jump walk below instead. */
static void walk_prefix(Index *self, const uint64_t *h, Py_ssize_t n, uint64_t active,
                        uint64_t kind, int role, Py_ssize_t *depth, uint64_t *drop)
{
    uint64_t maxp = max_probe(self), keys[PREFETCH], homes[PREFETCH], *s, m, gone;
    Py_ssize_t j;
    for (j = 0; j < n && j < PREFETCH; j++) {
        keys[j] = key_of(h[j], kind, role);
        __builtin_prefetch(slot_at(self, homes[j] = home_of(self, keys[j])));
    }
    for (j = 0; j < n && active != 0; j++) {
        uint64_t key = keys[j & (PREFETCH - 1)], home = homes[j & (PREFETCH - 1)];
        if (j + PREFETCH < n) { /* start the probe PREFETCH blocks ahead */
            uint64_t ahead = key_of(h[j + PREFETCH], kind, role);
            keys[j & (PREFETCH - 1)] = ahead;
            __builtin_prefetch(slot_at(self, homes[j & (PREFETCH - 1)] = home_of(self, ahead)));
        }
        m = 0;
        if ((s = ix_find_at(self, key, home, maxp)) != NULL) {
            m = LD(&s[SL_ROUTED]);
            if (kind == KIND_BLOCK)
                m |= LD(&s[SL_EVENT]);
        }
        for (gone = active & ~m; gone != 0; gone &= gone - 1) {
            depth[__builtin_ctzll(gone)] = j;
            drop[__builtin_ctzll(gone)] = m;
        }
        active &= m;
    }
    for (; active != 0; active &= active - 1) {
        depth[__builtin_ctzll(active)] = j;
        drop[__builtin_ctzll(active)] = 0;
    }
}

/* The jump walk of pick_kv (design: Dynamo's PositionalIndexer). A server's held blocks (event
 * bits, or event | routed bits) are prefix-closed along a prompt in normal operation: block
 * hashes chain from their parent, executors evict leaves first and free a block's descendants
 * with it, and a pick marks a whole prompt past its winner's event depth. So instead of probing
 * every block, the walk probes the last block of each window of JUMP blocks (j = JUMP - 1,
 * 2 JUMP - 1, ..., and n - 1 for the last, shorter window); a server holding that block is taken
 * to hold the whole window. Where servers drop out at a probe g of the window [lo, g], their
 * depths are found by bisection over [lo, g): probe mid; holders continue in [mid + 1, hi],
 * the others in [lo, mid], every server exactly as its own bisection would (probes are shared).
 * Cost: n / JUMP probes plus ~log2(JUMP) per window where servers drop out, instead of n.
 *
 * Result: equal to the linear walk (leading blocks held) whenever every active server's set is
 * prefix-closed along the prompt. With holes (lost events, a partial TTL expiry), for each
 * server s: let g be the first probe point s lacks (none: depth n); blocks before g's window are
 * assumed held (a hole there is not seen); the depth is where s's bisection over that window
 * ends: a position d in [lo, g] that s lacks (so drop[s] is always the mask of a probed block)
 * with d = lo or s holding block d - 1. So it is never past the first probe point s lacks, and
 * it can be past the linear depth (a hole skipped) or short of the blocks s holds past g. */
typedef struct {
    Index *ix;
    const uint64_t *h;
    Py_ssize_t n;
    uint64_t maxp;
    uint64_t **found; /* per hash: the slot if a probe found it, else NULL (absent or not probed) */
    int events_only;  /* 1: event bits only; 0: event | routed */
} Walk;

static inline uint64_t walk_mask(Walk *w, Py_ssize_t j)
{
    uint64_t *s = w->found[j];
    if (s == NULL) {
        uint64_t key = key_of(w->h[j], KIND_BLOCK, 0);
        if ((s = ix_find_at(w->ix, key, home_of(w->ix, key), w->maxp)) == NULL)
            return 0;
        w->found[j] = s; /* slots are never freed within a generation */
    }
    return w->events_only ? LD(&s[SL_EVENT]) : LD(&s[SL_ROUTED]) | LD(&s[SL_EVENT]);
}

/* Every server of `set` holds block lo - 1 (or lo = 0) and lacks block hi, whose mask is
 * hi_mask: find each one's depth in [lo, hi]. Recursion depth <= log2(JUMP) + 1. */
static void walk_bisect(Walk *w, Py_ssize_t lo, Py_ssize_t hi, uint64_t set, uint64_t hi_mask,
                        Py_ssize_t *depth, uint64_t *drop)
{
    while (set != 0 && lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        uint64_t m = walk_mask(w, mid);
        if (set & ~m)
            walk_bisect(w, lo, mid, set & ~m, m, depth, drop);
        set &= m;
        lo = mid + 1;
    }
    for (; set != 0; set &= set - 1) {
        depth[__builtin_ctzll(set)] = hi;
        drop[__builtin_ctzll(set)] = hi_mask;
    }
}

/* Depth of every server in `active` by the jump walk (above); drop[s] = the mask of block
 * depth[s] (0 for a server holding all n). Stops once no server is left. */
static void jump_walk(Walk *w, uint64_t active, Py_ssize_t *depth, uint64_t *drop)
{
    Py_ssize_t lo = 0, n = w->n, g, ahead;
    uint64_t m;
    /* (a second walk over the same prompt, events only, has most probe slots in found[]) */
    for (ahead = JUMP - 1; ahead < n && ahead < JUMP * JUMP_PREFETCH; ahead += JUMP)
        if (w->found[ahead] == NULL)
            prefetch_key(w->ix, key_of(w->h[ahead], KIND_BLOCK, 0));
    while (active != 0 && lo < n) {
        g = (n - lo > JUMP ? lo + JUMP : n) - 1;
        if ((ahead = g + JUMP * JUMP_PREFETCH) < n && w->found[ahead] == NULL) /* the probe JUMP_PREFETCH windows ahead */
            prefetch_key(w->ix, key_of(w->h[ahead], KIND_BLOCK, 0));
        m = walk_mask(w, g);
        if (active & ~m)
            walk_bisect(w, lo, g, active & ~m, m, depth, drop);
        active &= m;
        lo = g + 1;
    }
    for (; active != 0; active &= active - 1) {
        depth[__builtin_ctzll(active)] = n;
        drop[__builtin_ctzll(active)] = 0;
    }
}

/* Active requests and tokens of every candidate, summed over owned rows. */
static int cand_loads(Region *r, uint64_t cand, int64_t *req, int64_t *tok)
{
    int slots[MAX_SERVERS], n = 0;
    int64_t a[MAX_SERVERS], b[MAX_SERVERS];
    for (uint64_t m = cand; m != 0; m &= m - 1)
        slots[n++] = __builtin_ctzll(m);
    if (sum_loads(r, slots, n, 0, a) < 0 || sum_loads(r, slots, n, 1, b) < 0)
        return 0;
    for (int k = 0; k < n; k++) {
        req[slots[k]] = a[k];
        tok[slots[k]] = b[k];
    }
    return 1;
}

/* Least active tokens among `mask` (non-empty); ties rotate. -1 on error. */
static int least_tokens(Region *r, uint64_t mask, int role)
{
    int slots[MAX_SERVERS], n = 0;
    int64_t sums[MAX_SERVERS], best = INT64_MAX;
    uint64_t tied = 0;
    if (mask == 0)
        return -1;
    for (uint64_t m = mask; m != 0; m &= m - 1)
        slots[n++] = __builtin_ctzll(m);
    if (sum_loads(r, slots, n, 1, sums) < 0)
        return -1;
    for (int k = 0; k < n; k++) {
        if (sums[k] < best) {
            best = sums[k];
            tied = 0;
        }
        if (sums[k] == best)
            tied |= 1ULL << slots[k];
    }
    return pick_tied(r, role, tied);
}

typedef struct {
    int role, use_tokens;
    double load_weight, load_cap;
    uint64_t max_batch; /* the load_cap denominator; 0: each server's record */
    uint64_t cand;
    Py_ssize_t depth[MAX_SERVERS];
    uint64_t drop[MAX_SERVERS];
    Walk walk; /* found: slots any walk of this pick found, per hash */
} KvPick;

/* Score every candidate (fresh loads and prefix depths) and choose; -1 on error. `claimed`
 * servers are known to be taking block claim_at: their depth is at least claim_at + 1. */
static int kv_choose(Index *self, KvPick *k, uint64_t claimed, Py_ssize_t claim_at)
{
    int64_t req[MAX_SERVERS], tok[MAX_SERVERS];
    uint64_t qualify = 0, tied = 0;
    double best = -INFINITY, score, load;
    char *rec;
    if (!cand_loads(self->ctl, k->cand, req, tok))
        return -1;
    k->walk.events_only = 0;
    jump_walk(&k->walk, k->cand, k->depth, k->drop);
    for (uint64_t m = claimed & k->cand; m != 0; m &= m - 1)
        if (k->depth[__builtin_ctzll(m)] < claim_at + 1)
            k->depth[__builtin_ctzll(m)] = claim_at + 1;
    for (uint64_t m = k->cand; m != 0; m &= m - 1) {
        int s = __builtin_ctzll(m);
        uint64_t mbs;
        if ((rec = server_at(self->ctl, s)) == NULL)
            return -1;
        mbs = k->max_batch ? k->max_batch : LD((uint64_t *)(rec + S_MAXBATCH));
        if (!isfinite(k->load_cap) || mbs == 0 || (double)req[s] / (double)mbs < k->load_cap)
            qualify |= 1ULL << s;
    }
    if (qualify == 0)
        qualify = k->cand; /* every candidate is over the cap: all compete */
    for (uint64_t m = qualify; m != 0; m &= m - 1) {
        int s = __builtin_ctzll(m);
        if (k->use_tokens) {
            uint64_t tpb;
            if ((rec = server_at(self->ctl, s)) == NULL)
                return -1;
            tpb = LD((uint64_t *)(rec + S_TPB));
            load = (double)tok[s] / (double)(tpb ? tpb : DEFAULT_TPB);
        } else {
            load = (double)req[s];
        }
        score = (double)k->depth[s] - k->load_weight * load;
        if (score > best) {
            best = score;
            tied = 0;
        }
        if (score == best)
            tied |= 1ULL << s;
    }
    return pick_tied(self->ctl, k->role, tied);
}

/* Mark hashes [from, n) routed to `bit`'s server: slots a walk found are reused, the rest are
 * looked up or inserted with one reservation for all of them and their lines fetched for writing
 * ahead. The reservation is an upper bound (a hash the jump walk did not probe counts as missing
 * though it may be there); what the inserts do not use is returned at once. */
static void commit_routed(Index *self, KvPick *k, Py_ssize_t from, uint64_t bit)
{
    uint64_t now = monotonic_ns(), *s, missing = 0, **found = k->walk.found;
    const uint64_t *h = k->walk.h;
    Py_ssize_t ahead = from, n = k->walk.n;
    Budget b;
    for (Py_ssize_t j = from; j < n; j++)
        missing += found[j] == NULL;
    budget_take(self, &b, missing);
    for (Py_ssize_t j = from; j < n; j++) {
        if ((s = found[j]) == NULL) {
            for (ahead = ahead > j ? ahead : j + 1; ahead < n && ahead <= j + PREFETCH; ahead++)
                if (found[ahead] == NULL)
                    __builtin_prefetch(slot_at(self, home_of(self, key_of(h[ahead], KIND_BLOCK, 0))), 1);
            if ((s = ix_upsert_b(self, key_of(h[j], KIND_BLOCK, 0), 1, &b)) == NULL)
                break; /* full: the chain is unreachable past this block anyway */
        }
        routed_set(s, bit, now, KIND_BLOCK);
    }
    budget_return(self, &b);
}

/* Common head of the picks: (row, role, exclude) -> own row and candidate mask. NULL on error. */
static char *pick_head(Index *self, PyObject *const *args, int64_t *role, uint64_t *cand)
{
    char *p = NULL;
    int64_t row, exclude;
    uint64_t c[CFG_WORDS];
    if (!arg_i64(args[0], &row) || !arg_range(args[1], 0, MAX_ROLES - 1, "role", role) ||
        !arg_i64(args[2], &exclude) || !ix_ok(self, 1) || (p = own_row(self->ctl, row, 0)) == NULL)
        goto fail;
    if (!config_for_pick(self->ctl, c)) {
        p = NULL;
        goto fail;
    }
    *cand = c[K_PRESENT] & c[K_HEALTHY] & c[K_ROLE0 + *role];
    if (exclude >= 0 && exclude < (int64_t)MAX_SERVERS)
        *cand &= ~(1ULL << exclude);
fail:
    return p;
}

/* pick_kv(row, role, exclude_slot, hashes, num_tokens, load_weight, load_cap, use_tokens,
 *         track_routed[, max_batch_size]) -> (slot, matched_blocks) | (-1, 0) | None (generation
 * changed: remap). max_batch_size is the load_cap denominator for every candidate (TensorRT-LLM's
 * router arg); 0 or absent: each server's record (its /server_info value). */
PyObject *Index_pick_kv(Index *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    KvPick k;
    int64_t role, tokens, max_batch = 0;
    int track, slot = -1, rerun = 0;
    uint64_t bit, *s, r, other, *found_stack[FOUND_STACK], edrop[MAX_SERVERS];
    Py_ssize_t d = 0, edepth[MAX_SERVERS];
    Hashes hb = {0};
    char *p;
    k.walk.found = found_stack;
    if (!nargs_ok("pick_kv", nargs, nargs == 10 ? 10 : 9) ||
        (p = pick_head(self, args, &role, &k.cand)) == NULL ||
        !hashes_open(args[3], &hb) || !arg_range(args[4], 0, INT64_MAX, "num_tokens", &tokens) ||
        !arg_double(args[5], "load_weight", &k.load_weight) ||
        !arg_double(args[6], "load_cap", &k.load_cap) ||
        (k.use_tokens = PyObject_IsTrue(args[7])) < 0 || (track = PyObject_IsTrue(args[8])) < 0 ||
        (nargs == 10 && !arg_range(args[9], 0, INT64_MAX, "max_batch_size", &max_batch)))
        goto fail;
    k.max_batch = (uint64_t)max_batch;
    if (stale(self)) {
        result = Py_NewRef(Py_None);
        goto fail;
    }
    k.role = (int)role;
    if (hb.n > FOUND_STACK &&
        (k.walk.found = PyMem_Malloc((size_t)hb.n * sizeof(uint64_t *))) == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    if (hb.n > 0)
        memset(k.walk.found, 0, (size_t)hb.n * sizeof(uint64_t *));
    k.walk.ix = self;
    k.walk.h = hb.h;
    k.walk.n = hb.n;
    k.walk.maxp = max_probe(self);
    if (k.cand != 0) {
        if ((slot = kv_choose(self, &k, 0, 0)) < 0)
            goto fail;
        d = k.depth[slot];
        if (track && d < hb.n && (s = ix_upsert(self, key_of(hb.h[d], KIND_BLOCK, 0), 1)) != NULL) {
            /* Claim the first block beyond our match. If another worker has meanwhile given that
             * very block to a different candidate, it routed this prefix there: score again once,
             * counting that server as holding the block, so racing workers converge. */
            for (int tries = 0; tries < CLAIM_TRIES; tries++) {
                bit = 1ULL << slot;
                r = LDA(&s[SL_ROUTED]);
                other = (r | LD(&s[SL_EVENT])) & k.cand & ~k.drop[slot] & ~bit;
                if (other != 0 && !rerun) {
                    Py_ssize_t claim_at = d;
                    rerun = 1;
                    ADD(U64(self->ctl, IC_RACE_RERUNS), 1);
                    if ((slot = kv_choose(self, &k, other, claim_at)) < 0)
                        goto fail;
                    d = k.depth[slot];
                    break;
                }
                if ((r & bit) || __atomic_compare_exchange_n(&s[SL_ROUTED], &r, r | bit, 0,
                                                             __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
                    break;
            }
        }
        if (track) {
            /* The winner needs routed bits only past the blocks its KV events confirm: its
             * event-only depth (the same jump walk; the grid probes are the ones just read). */
            k.walk.events_only = 1;
            jump_walk(&k.walk, 1ULL << slot, edepth, edrop);
            commit_routed(self, &k, edepth[slot] < d ? edepth[slot] : d, 1ULL << slot);
        }
        if (d > hb.n)
            d = hb.n;
        row_add_pick(p, slot, tokens);
    }
    result = Py_BuildValue("(in)", slot, slot >= 0 ? d : (Py_ssize_t)0);
fail:
    if (k.walk.found != found_stack)
        PyMem_Free(k.walk.found);
    hashes_close(&hb);
    return result;
}

/* match(hashes, role=-1, jump=False) -> [(slot, depth)] for present, healthy servers (of `role`
 * if >= 0), or None when the generation changed. Read-only. Depths by the linear walk (leading
 * blocks held), or with `jump` by pick_kv's jump walk (tests and diagnostics). */
PyObject *Index_match(Index *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL, *item;
    Hashes hb = {0};
    int64_t role = -1;
    int jump = 0;
    uint64_t c[CFG_WORDS], cand, drop[MAX_SERVERS], *found_stack[FOUND_STACK];
    Py_ssize_t depth[MAX_SERVERS];
    Walk w = {.found = found_stack};
    if (nargs < 1 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "match(hashes, role=-1, jump=False)");
        goto fail;
    }
    if ((nargs >= 2 && !arg_range(args[1], -1, MAX_ROLES - 1, "role", &role)) ||
        (nargs == 3 && (jump = PyObject_IsTrue(args[2])) < 0) || !ix_ok(self, 0) ||
        !hashes_open(args[0], &hb) || !config_for_pick(self->ctl, c))
        goto fail;
    if (stale(self)) {
        result = Py_NewRef(Py_None);
        goto fail;
    }
    cand = c[K_PRESENT] & c[K_HEALTHY];
    if (role >= 0)
        cand &= c[K_ROLE0 + role];
    if (!jump) {
        walk_prefix(self, hb.h, hb.n, cand, KIND_BLOCK, 0, depth, drop);
    } else {
        if (hb.n > FOUND_STACK && (w.found = PyMem_Malloc((size_t)hb.n * sizeof(uint64_t *))) == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        if (hb.n > 0)
            memset(w.found, 0, (size_t)hb.n * sizeof(uint64_t *));
        w.ix = self;
        w.h = hb.h;
        w.n = hb.n;
        w.maxp = max_probe(self);
        jump_walk(&w, cand, depth, drop);
    }
    if ((result = PyList_New(0)) == NULL)
        goto fail;
    for (uint64_t m = cand; m != 0; m &= m - 1) {
        int s = __builtin_ctzll(m);
        if ((item = Py_BuildValue("(in)", s, depth[s])) == NULL || PyList_Append(result, item) < 0) {
            Py_XDECREF(item);
            Py_CLEAR(result);
            goto fail;
        }
        Py_DECREF(item);
    }
fail:
    if (w.found != found_stack)
        PyMem_Free(w.found);
    hashes_close(&hb);
    return result;
}

/* conv_pick_explicit(row, role, exclude_slot, conv_key, num_tokens) -> slot | -1 | None
 * Sticky by conversation across every worker: the first decider's CAS 0 -> server wins; a session
 * whose server is no longer a candidate is re-routed by CAS-replacing its mask; new sessions go
 * to the candidate with the fewest active tokens. The session's stamp is refreshed on each use. */
PyObject *Index_conv_pick_explicit(Index *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    int64_t role, tokens;
    uint64_t cand, conv, *s, r;
    int slot = -1;
    char *p;
    if (!nargs_ok("conv_pick_explicit", nargs, 5) || (p = pick_head(self, args, &role, &cand)) == NULL ||
        !arg_u64(args[3], &conv) || !arg_range(args[4], 0, INT64_MAX, "num_tokens", &tokens))
        goto fail;
    if (stale(self)) {
        result = Py_NewRef(Py_None);
        goto fail;
    }
    if (cand != 0) {
        s = ix_upsert(self, key_of(conv, KIND_CONV, (int)role), 1);
        for (int tries = 0; s != NULL && slot < 0 && tries < CLAIM_TRIES; tries++) {
            r = LDA(&s[SL_ROUTED]);
            if (r & cand) {
                slot = __builtin_ctzll(r & cand); /* sticky */
            } else {
                int w = least_tokens(self->ctl, cand, (int)role);
                if (w < 0)
                    goto fail;
                if (__atomic_compare_exchange_n(&s[SL_ROUTED], &r, 1ULL << w, 0, __ATOMIC_ACQ_REL,
                                                __ATOMIC_RELAXED))
                    slot = w;
            }
        }
        if (slot < 0 && (slot = least_tokens(self->ctl, cand, (int)role)) < 0)
            goto fail; /* full index (counted) or an endless CAS fight: not sticky this time */
        if (s != NULL)
            ST(&s[SL_TS], (monotonic_ns() & TS_MASK) | KIND_CONV << TS_KIND_SHIFT);
        row_add_pick(p, slot, tokens);
    }
    result = PyLong_FromLong(slot);
fail:
    return result;
}

/* conv_pick_implicit(row, role, exclude_slot, hashes, num_tokens, match_threshold)
 *   -> (slot, depth) | (-1, 0) | None
 * The deepest prefix of `hashes` any candidate was routed before; if depth / len(hashes) >=
 * match_threshold the least-loaded of the deepest servers, else the least-loaded candidate (by
 * active tokens). The hashes are then recorded as routed to the chosen server. */
PyObject *Index_conv_pick_implicit(Index *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    int64_t role, tokens;
    uint64_t cand, deepest = 0, bit, now, *s, drop[MAX_SERVERS];
    Py_ssize_t depth[MAX_SERVERS], dmax = 0;
    double threshold;
    int slot = -1;
    Hashes hb = {0};
    char *p;
    if (!nargs_ok("conv_pick_implicit", nargs, 6) || (p = pick_head(self, args, &role, &cand)) == NULL ||
        !hashes_open(args[3], &hb) || !arg_range(args[4], 0, INT64_MAX, "num_tokens", &tokens) ||
        !arg_double(args[5], "match_threshold", &threshold))
        goto fail;
    if (stale(self)) {
        result = Py_NewRef(Py_None);
        goto fail;
    }
    if (cand != 0) {
        walk_prefix(self, hb.h, hb.n, cand, KIND_IMPL, (int)role, depth, drop);
        for (uint64_t m = cand; m != 0; m &= m - 1) {
            int sl = __builtin_ctzll(m);
            if (depth[sl] > dmax) {
                dmax = depth[sl];
                deepest = 0;
            }
            if (depth[sl] == dmax)
                deepest |= 1ULL << sl;
        }
        if (!(hb.n > 0 && dmax > 0 && (double)dmax / (double)hb.n >= threshold))
            deepest = cand;
        if ((slot = least_tokens(self->ctl, deepest, (int)role)) < 0)
            goto fail;
        now = monotonic_ns();
        bit = 1ULL << slot;
        for (Py_ssize_t j = 0; j < hb.n; j++) {
            if ((s = ix_upsert(self, key_of(hb.h[j], KIND_IMPL, (int)role), 1)) == NULL)
                break;
            routed_set(s, bit, now, KIND_IMPL);
        }
        row_add_pick(p, slot, tokens);
    }
    result = Py_BuildValue("(in)", slot, slot >= 0 ? depth[slot] : (Py_ssize_t)0);
fail:
    hashes_close(&hb);
    return result;
}
