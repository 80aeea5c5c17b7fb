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

/* Server sets are `Set`s of nw = max_servers / 64 words. The functions below take `nw` and are
 * always inlined; each Python entry point dispatches on nw == 1, so a table of 64 servers runs
 * the one-word code (the constant folds every loop over words away), and only wider tables pay
 * for the words they have. */

/* Every member s of `set`: depth[s] = d, and (drop != NULL) drop[s] = *dm. */
INLINE void set_depths(const Set *set, Py_ssize_t d, const Set *dm, Py_ssize_t *depth, Set *drop, int nw)
{
    for (int i = 0; i < nw; i++)
        for (uint64_t m = set->w[i]; m != 0; m &= m - 1) {
            int s = 64 * i + __builtin_ctzll(m);
            depth[s] = d;
            if (drop != NULL)
                for (int k = 0; k < nw; k++)
                    drop[s].w[k] = dm->w[k];
        }
}

/* Prefix depth of every server in `active` by the linear walk (match, implicit conversations):
 * depth[s] = leading hashes whose mask (routed, plus event for blocks) has s's bit. Stops once
 * no server is left (design section 4.3). pick_kv uses the jump walk below instead. */
INLINE void walk_prefix_nw(Index *self, const uint64_t *h, Py_ssize_t n, Set active, uint64_t kind,
                           int role, Py_ssize_t *depth, int nw)
{
    uint64_t maxp = max_probe(self), keys[PREFETCH], homes[PREFETCH], *s;
    Set m;
    Py_ssize_t j;
    for (j = 0; j < n && j < PREFETCH; j++) {
        keys[j] = key_of(h[j], kind, role);
        __builtin_prefetch(slot_at_nw(self, homes[j] = home_of(self, keys[j]), nw));
    }
    for (j = 0; j < n && set_any(&active, nw); j++) {
        uint64_t key = keys[j & (PREFETCH - 1)], home = homes[j & (PREFETCH - 1)];
        if (j + PREFETCH < n) { /* start the probe PREFETCH blocks ahead */
            uint64_t ahead = key_of(h[j + PREFETCH], kind, role);
            keys[j & (PREFETCH - 1)] = ahead;
            __builtin_prefetch(slot_at_nw(self, homes[j & (PREFETCH - 1)] = home_of(self, ahead), nw));
        }
        s = ix_find_at_nw(self, key, home, maxp, nw);
        for (int i = 0; i < nw; i++) {
            m.w[i] = 0;
            if (s != NULL && (nw == 1 || active.w[i] != 0))
                m.w[i] = LD(&s[SL_RT(i)]) | (kind == KIND_BLOCK ? LD(&s[SL_EV(i)]) : 0);
            m.w[i] = active.w[i] & ~m.w[i]; /* gone here */
        }
        set_depths(&m, j, NULL, depth, NULL, nw);
        for (int i = 0; i < nw; i++)
            active.w[i] &= ~m.w[i];
    }
    set_depths(&active, j, NULL, depth, NULL, nw);
}

static void walk_prefix(Index *self, const uint64_t *h, Py_ssize_t n, const Set *active, uint64_t kind,
                        int role, Py_ssize_t *depth)
{
    if (self->nw == 1)
        walk_prefix_nw(self, h, n, *active, kind, role, depth, 1);
    else
        walk_prefix_nw(self, h, n, *active, kind, role, depth, self->nw);
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
    unsigned words;   /* bit i: word i of the masks is read (it holds a server of the walk) */
} Walk;

/* The mask of block j (event | routed, or event only), the words outside `words` left 0. */
INLINE void walk_mask(Walk *w, Py_ssize_t j, Set *out, int nw)
{
    uint64_t *s = w->found[j];
    if (s == NULL) {
        uint64_t key = key_of(w->h[j], KIND_BLOCK, 0);
        s = ix_find_at_nw(w->ix, key, home_of(w->ix, key), w->maxp, nw);
        w->found[j] = s; /* slots are never freed within a generation */
    }
    for (int i = 0; i < nw; i++) {
        out->w[i] = 0;
        if (s != NULL && (nw == 1 || (w->words >> i & 1)))
            out->w[i] = w->events_only ? LD(&s[SL_EV(i)]) : LD(&s[SL_RT(i)]) | LD(&s[SL_EV(i)]);
    }
}

/* Every server of `set` holds block lo - 1 (or lo = 0) and lacks block hi, whose mask is
 * hi_mask: find each one's depth in [lo, hi]. The spans left for later (the servers that lack a
 * mid-point, in [lo, mid]) wait on a stack; they are disjoint and each ends at its own block of
 * the window, so at most JUMP wait at once. */
typedef struct {
    Py_ssize_t lo, hi;
    Set set, hi_mask;
} Span;

INLINE void walk_bisect(Walk *w, Py_ssize_t lo, Py_ssize_t hi, Set set, Set hi_mask, Py_ssize_t *depth,
                        Set *drop, int nw)
{
    Span stack[JUMP];
    int top = 0;
    Set m;
    for (;;) {
        while (set_any(&set, nw) && lo < hi) {
            Py_ssize_t mid = lo + (hi - lo) / 2;
            Span *later = &stack[top];
            walk_mask(w, mid, &m, nw);
            for (int i = 0; i < nw; i++) {
                later->set.w[i] = set.w[i] & ~m.w[i];
                later->hi_mask.w[i] = m.w[i];
                set.w[i] &= m.w[i];
            }
            if (set_any(&later->set, nw) && top < JUMP) { /* never full: see above */
                later->lo = lo;
                later->hi = mid;
                top++;
            }
            lo = mid + 1;
        }
        set_depths(&set, hi, &hi_mask, depth, drop, nw);
        if (top == 0)
            break;
        top--;
        lo = stack[top].lo;
        hi = stack[top].hi;
        set = stack[top].set;
        hi_mask = stack[top].hi_mask;
    }
}

/* Depth of every server in `active` by the jump walk (above); drop[s] (if drop != NULL) = the
 * mask of block depth[s] (0 for a server holding all n). Stops once no server is left. */
INLINE void jump_walk(Walk *w, Set active, Py_ssize_t *depth, Set *drop, int nw)
{
    Py_ssize_t lo = 0, n = w->n, g, ahead;
    Set m, gone, none = {{0}};
    /* (a second walk over the same prompt, events only, has most probe slots in found[]) */
    for (ahead = JUMP - 1; ahead < n && ahead < JUMP * JUMP_PREFETCH; ahead += JUMP)
        if (w->found[ahead] == NULL)
            prefetch_key(w->ix, key_of(w->h[ahead], KIND_BLOCK, 0));
    while (set_any(&active, nw) && lo < n) {
        g = (n - lo > JUMP ? lo + JUMP : n) - 1;
        if ((ahead = g + JUMP * JUMP_PREFETCH) < n && w->found[ahead] == NULL) /* the probe JUMP_PREFETCH windows ahead */
            prefetch_key(w->ix, key_of(w->h[ahead], KIND_BLOCK, 0));
        walk_mask(w, g, &m, nw);
        for (int i = 0; i < nw; i++)
            gone.w[i] = active.w[i] & ~m.w[i];
        if (set_any(&gone, nw))
            walk_bisect(w, lo, g, gone, m, depth, drop, nw);
        for (int i = 0; i < nw; i++)
            active.w[i] &= m.w[i];
        lo = g + 1;
    }
    set_depths(&active, n, &none, depth, drop, nw);
}

/* Bit i set for each word i of `s` with a member. */
INLINE unsigned set_words(const Set *s, int nw)
{
    unsigned words = 0;
    for (int i = 0; i < nw; i++)
        words |= (unsigned)(s->w[i] != 0) << i;
    return words;
}

/* Active requests and tokens of every candidate, summed over owned rows. */
INLINE int cand_loads(Region *r, const Set *cand, int64_t *req, int64_t *tok, int nw)
{
    int slots[MAX_SERVERS_LIMIT], n = set_slots(cand, nw, slots);
    int64_t a[MAX_SERVERS_LIMIT], b[MAX_SERVERS_LIMIT];
    if (sum_loads(r, slots, n, 0, a) < 0 || sum_loads(r, slots, n, 1, b) < 0)
        return 0;
    for (int k = 0; k < n; k++) {
        req[slots[k]] = a[k];
        tok[slots[k]] = b[k];
    }
    return 1;
}

/* Least active tokens among `mask` (non-empty); ties rotate. -1 on error or an empty mask. */
static int least_tokens(Region *r, const Set *mask, int role)
{
    int slots[MAX_SERVERS_LIMIT], tied[MAX_SERVERS_LIMIT], n = set_slots(mask, r->nw, slots), nt = 0;
    int64_t sums[MAX_SERVERS_LIMIT], best = INT64_MAX;
    if (n == 0 || sum_loads(r, slots, n, 1, sums) < 0)
        return -1;
    for (int k = 0; k < n; k++) {
        if (sums[k] < best) {
            best = sums[k];
            nt = 0;
        }
        if (sums[k] == best)
            tied[nt++] = slots[k];
    }
    return pick_tied(r, role, tied, nt);
}

typedef struct {
    int role, use_tokens;
    int pinned; /* the conversation's pinned server, -1 none */
    double load_weight, load_cap;
    uint64_t max_batch; /* the load_cap denominator; 0: each server's record */
    int64_t defer_min;  /* pick_kv_claim: fewer blocks to mark than this are marked at once */
    Set cand;
    Py_ssize_t depth[MAX_SERVERS_LIMIT];
    Set drop[MAX_SERVERS_LIMIT];
    Walk walk; /* found: slots any walk of this pick found, per hash */
} KvPick;

/* Score every candidate (fresh loads and prefix depths) and choose; -1 on error. `claimed`
 * servers are known to be taking block claim_at: their depth is at least claim_at + 1. */
INLINE int kv_choose(Index *self, KvPick *k, const Set *claimed, Py_ssize_t claim_at, int nw)
{
    int64_t req[MAX_SERVERS_LIMIT], tok[MAX_SERVERS_LIMIT];
    int slots[MAX_SERVERS_LIMIT], qualify[MAX_SERVERS_LIMIT], tied[MAX_SERVERS_LIMIT];
    int n, nq = 0, nt = 0;
    double best = -INFINITY, score, load;
    if (!cand_loads(self->ctl, &k->cand, req, tok, nw))
        return -1;
    k->walk.events_only = 0;
    k->walk.words = set_words(&k->cand, nw);
    jump_walk(&k->walk, k->cand, k->depth, k->drop, nw);
    for (int i = 0; i < nw; i++)
        for (uint64_t m = claimed->w[i] & k->cand.w[i]; m != 0; m &= m - 1) {
            int s = 64 * i + __builtin_ctzll(m);
            if (k->depth[s] < claim_at + 1)
                k->depth[s] = claim_at + 1;
        }
    n = set_slots(&k->cand, nw, slots);
    for (int j = 0; j < n; j++) {
        int s = slots[j];
        uint64_t mbs = k->max_batch ? k->max_batch : LD((uint64_t *)(server_rec(self->ctl, s) + S_MAXBATCH));
        if (!isfinite(k->load_cap) || mbs == 0 || (double)req[s] / (double)mbs < k->load_cap)
            qualify[nq++] = s;
    }
    if (nq == 0) { /* every candidate is over the cap: all compete */
        memcpy(qualify, slots, (size_t)n * sizeof(int));
        nq = n;
    }
    if (k->pinned >= 0)
        for (int j = 0; j < nq; j++)
            if (qualify[j] == k->pinned) /* a conversation's pin under the cap wins, scores unread; */
                return pick_tied(self->ctl, k->role, &k->pinned, 1); /* the tie rotation moves on */
    for (int j = 0; j < nq; j++) {
        int s = qualify[j];
        if (k->use_tokens) {
            uint64_t tpb = LD((uint64_t *)(server_rec(self->ctl, s) + S_TPB));
            load = (double)tok[s] / (double)(tpb ? tpb : DEFAULT_TPB);
        } else {
            load = (double)req[s];
        }
        score = (double)k->depth[s] - k->load_weight * load;
        if (score > best) {
            best = score;
            nt = 0;
        }
        if (score == best)
            tied[nt++] = s;
    }
    return pick_tied(self->ctl, k->role, tied, nt);
}

/* Mark hashes [from, n) routed to `server`: slots a walk found are reused, the rest are looked
 * up or inserted with one reservation for all of them and their lines fetched for writing
 * ahead. The reservation is an upper bound (a hash the jump walk did not probe counts as missing
 * though it may be there); what the inserts do not use is returned at once. */
INLINE Py_ssize_t commit_routed(Index *self, const Walk *w, Py_ssize_t from, int server, int nw)
{
    uint64_t now = monotonic_ns(), *s, missing = 0, **found = w->found;
    const uint64_t *h = w->h;
    Py_ssize_t ahead = from, n = w->n, j;
    Budget b;
    for (Py_ssize_t j = from; j < n; j++)
        missing += found[j] == NULL;
    budget_take(self, &b, missing);
    for (j = from; j < n; j++) {
        if ((s = found[j]) == NULL) {
            for (ahead = ahead > j ? ahead : j + 1; ahead < n && ahead <= j + PREFETCH; ahead++)
                if (found[ahead] == NULL)
                    __builtin_prefetch(slot_at_nw(self, home_of(self, key_of(h[ahead], KIND_BLOCK, 0)), nw), 1);
            if ((s = ix_upsert_b(self, key_of(h[j], KIND_BLOCK, 0), 1, &b)) == NULL)
                break; /* full: the chain is unreachable past this block anyway */
        }
        routed_set(s, server, now, KIND_BLOCK, nw);
    }
    budget_return(self, &b);
    return j - from;
}

/* Common head of the picks: (row, role, exclude) -> own row and candidate set. NULL on error. */
static char *pick_head(Index *self, PyObject *const *args, int64_t *role, Set *cand)
{
    char *p = NULL;
    int64_t row, exclude;
    Config c;
    if (!arg_i64(args[0], &row) || !arg_range(args[1], 0, MAX_ROLES - 1, "role", role) ||
        !arg_i64(args[2], &exclude) || !ix_ok(self, 1) || (p = own_row(self->ctl, row, 0)) == NULL)
        goto fail;
    if (self->nw == 1 ? !config_for_pick_nw(self->ctl, &c, 1) : !config_for_pick_nw(self->ctl, &c, self->nw)) {
        p = NULL;
        goto fail;
    }
    if (self->nw == 1)
        candidates(&c, (int)*role, exclude, 1, cand);
    else
        candidates(&c, (int)*role, exclude, self->nw, cand);
fail:
    return p;
}

/* The candidates of k->cand that hold block `s` now (event or routed bit) but did not when the
 * walk read it (k->drop[slot]), less `slot` itself; *r gets slot's routed word (acquire). */
INLINE void gained(const KvPick *k, const uint64_t *s, int slot, uint64_t *r, Set *other, int nw)
{
    for (int i = 0; i < nw; i++) {
        uint64_t rw = LDA(&s[SL_RT(i)]);
        if (i == slot >> 6)
            *r = rw;
        other->w[i] = (rw | LD(&s[SL_EV(i)])) & k->cand.w[i] & ~k->drop[slot].w[i];
    }
    other->w[slot >> 6] &= ~(1ULL << (slot & 63));
}

/* The claim of block s (the first past the winner's match) where the masks span several words,
 * so no single CAS of a routed word sees every racer. The block's stamp serialises the claims
 * instead: read the stamp, then the masks (a candidate that gained the block since the walk:
 * score again once, as with one word); set the winner's bit, then CAS the stamp from the value
 * read. The first claimer's CAS succeeds; a later one fails (its stamp moved), and reading the
 * masks again it finds the first one's bit (set before that CAS, published by it): it takes
 * its own bit back (else its re-score would count it as holding the block, and keep it) and
 * scores again. A routing of the block by another pick also moves the stamp: the masks are
 * read again and the claim retried. Measured: tests/stress/test_index_multiproc.py races two
 * workers on 1,000 fresh prefixes over servers in four words; with a CAS of the winner's word
 * alone they split a few rounds a run, with this none in 14 runs. */
INLINE int claim_wide(Index *self, KvPick *k, uint64_t *s, int *slot_io, Py_ssize_t *d_io, int nw)
{
    int slot = *slot_io, mine = 0;
    uint64_t r = 0, t0, bit, stamp;
    Set other;
    for (int tries = 0; tries < CLAIM_TRIES; tries++) {
        t0 = LDA(&s[SL_TS(nw)]);
        gained(k, s, slot, &r, &other, nw);
        bit = 1ULL << (slot & 63);
        if (!set_any(&other, nw) && !(r & bit)) {
            __atomic_fetch_or(&s[SL_RT(slot >> 6)], bit, __ATOMIC_SEQ_CST);
            mine = 1;
            stamp = (monotonic_ns() & TS_MASK) | KIND_BLOCK << TS_KIND_SHIFT;
            if (__atomic_compare_exchange_n(&s[SL_TS(nw)], &t0, stamp, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
                break; /* claimed first */
            gained(k, s, slot, &r, &other, nw);
        }
        if (set_any(&other, nw)) {
            Py_ssize_t claim_at = *d_io;
            ADD(U64(self->ctl, IC_RACE_RERUNS), 1);
            if (mine) /* take back the bit this claim set (not one an earlier pick set) before */
                __atomic_fetch_and(&s[SL_RT(slot >> 6)], ~bit, __ATOMIC_RELAXED); /* scoring again */
            if ((slot = kv_choose(self, k, &other, claim_at, nw)) < 0)
                return 0;
            *d_io = k->depth[slot];
            break; /* the commit marks the block for whichever server won */
        }
        if (r & bit)
            break; /* ours already (an earlier pick, or our own bit with the stamp moved by a refresh) */
    }
    *slot_io = slot;
    return 1;
}

/* The decision of pick_kv once its arguments are read: (slot, matched) into *slot / *d; 0 on
 * error. With track: the claim of the first block past the match and the routed bits; with
 * `from_out` (pick_kv_claim) the routed bits are not set but their first block is stored there
 * (hb->n: none), for commit_routed once the leg is sent. */
INLINE int kv_decide(Index *self, KvPick *k, const Hashes *hb, int track, int *slot_out, Py_ssize_t *d_out,
                     Py_ssize_t *from_out, int nw)
{
    int slot, rerun = 0;
    uint64_t bit, *s, r = 0;
    Py_ssize_t d, edepth[MAX_SERVERS_LIMIT];
    Set other, none = {{0}}, one = {{0}};
    if ((slot = kv_choose(self, k, &none, 0, nw)) < 0)
        return 0;
    d = k->depth[slot];
    if (track && d < hb->n && (s = ix_upsert(self, key_of(hb->h[d], KIND_BLOCK, 0), 1)) != NULL) {
        /* Claim the first block beyond our match. If another worker has meanwhile given that
         * very block to a different candidate, it routed this prefix there: score again once,
         * counting that server as holding the block, so racing workers converge. One word: a
         * CAS of the routed mask decides. Several: claim_wide. */
        if (nw > 1) {
            if (!claim_wide(self, k, s, &slot, &d, nw))
                return 0;
            goto claimed;
        }
        for (int tries = 0; tries < CLAIM_TRIES; tries++) {
            bit = 1ULL << (slot & 63);
            gained(k, s, slot, &r, &other, nw);
            if (set_any(&other, nw) && !rerun) {
                Py_ssize_t claim_at = d;
                rerun = 1;
                ADD(U64(self->ctl, IC_RACE_RERUNS), 1);
                if ((slot = kv_choose(self, k, &other, claim_at, nw)) < 0)
                    return 0;
                d = k->depth[slot];
                break;
            }
            if ((r & bit) || __atomic_compare_exchange_n(&s[SL_RT(slot >> 6)], &r, r | bit, 0,
                                                         __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
                break;
        }
    }
claimed:
    if (track) {
        /* The winner needs routed bits only past the blocks its KV events confirm: its
         * event-only depth (the same jump walk; the grid probes are the ones just read). */
        one.w[slot >> 6] = 1ULL << (slot & 63);
        k->walk.events_only = 1;
        k->walk.words = 1u << (slot >> 6);
        jump_walk(&k->walk, one, edepth, NULL, nw);
        Py_ssize_t from = edepth[slot] < d ? edepth[slot] : d;
        if (from_out != NULL && hb->n - from >= k->defer_min)
            *from_out = from;
        else
            commit_routed(self, &k->walk, from, slot, nw);
    }
    *slot_out = slot;
    *d_out = d > hb->n ? hb->n : d;
    return 1;
}

/* pick_kv(row, role, exclude_slot, hashes, num_tokens, load_weight, load_cap, use_tokens,
 *         track_routed[, max_batch_size[, pin_key]]) -> (slot, matched_blocks) | (-1, 0) | None
 * (generation changed: remap). max_batch_size is the load_cap denominator for every candidate
 * (TensorRT-LLM's router arg); 0 or absent: each server's record (its /server_info value).
 * pin_key (0: none) names a conversation: the server it was last routed to wins while it is a
 * candidate under the cap, and the winner becomes its pin (a session slot of the index, LRU as
 * the conversation router's; TensorRT-LLM's KvCacheAwareRouter._route_affinity).
 * `claim`: pick_kv_claim(the same 11 arguments, defer_min): routed bits past the claim on
 * defer_min blocks or more are left to commit_routed (fewer are set at once), and the result is
 * (slot, matched_blocks, commit_from), commit_from -1 when nothing is left to mark. */
static PyObject *pick_kv_impl(Index *self, PyObject *const *args, Py_ssize_t nargs, int claim)
{
    PyObject *result = NULL;
    KvPick k;
    int64_t role, tokens, max_batch = 0;
    int track, ok, slot = -1;
    uint64_t *found_stack[FOUND_STACK];
    Py_ssize_t d = 0, from = -1;
    Py_ssize_t *from_out = NULL;
    Hashes hb = {0};
    char *p;
    uint64_t pin = 0, *ps = NULL;
    k.walk.found = found_stack;
    k.defer_min = 0;
    if (!(claim ? nargs_ok("pick_kv_claim", nargs, 12) && arg_range(args[11], 1, INT64_MAX, "defer_min", &k.defer_min)
                : nargs_ok("pick_kv", nargs, nargs >= 10 ? (nargs == 11 ? 11 : 10) : 9)) ||
        (p = pick_head(self, args, &role, &k.cand)) == NULL ||
        !hashes_open(args[3], &hb) || !arg_range(args[4], 0, INT64_MAX, "num_tokens", &tokens) ||
        !arg_double(args[5], "load_weight", &k.load_weight) ||
        !arg_double(args[6], "load_cap", &k.load_cap) ||
        (k.use_tokens = PyObject_IsTrue(args[7])) < 0 || (track = PyObject_IsTrue(args[8])) < 0 ||
        (nargs >= 10 && !arg_range(args[9], 0, INT64_MAX, "max_batch_size", &max_batch)) ||
        (nargs == 11 && !arg_u64(args[10], &pin)))
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
    k.pinned = -1;
    if (claim) {
        from = hb.n;
        from_out = &from;
    }
    if (set_any(&k.cand, self->nw)) {
        if (pin != 0 && (ps = ix_upsert(self, key_of(pin, KIND_CONV, (int)role), 1)) != NULL) {
            /* the stamp first: it marks the slot a session before any value (conv_pick_explicit) */
            ST(&ps[SL_TS(self->nw)], (monotonic_ns() & TS_MASK) | KIND_CONV << TS_KIND_SHIFT);
            k.pinned = session_server(LDA(&ps[SL_RT(0)]), self->nw);
        }
        ok = self->nw == 1 ? kv_decide(self, &k, &hb, track, &slot, &d, from_out, 1)
                           : kv_decide(self, &k, &hb, track, &slot, &d, from_out, self->nw);
        if (!ok)
            goto fail;
        if (ps != NULL && slot != k.pinned) /* the last decision is the pin, as TensorRT-LLM's */
            __atomic_store_n(&ps[SL_RT(0)], (uint64_t)slot + 1, __ATOMIC_RELEASE); /* affinity map */
        row_add_pick(self->ctl, p, slot, tokens);
    }
    if (claim)
        result = Py_BuildValue("(inn)", slot, slot >= 0 ? d : (Py_ssize_t)0,
                               slot >= 0 && track && from < hb.n ? from : (Py_ssize_t)-1);
    else
        result = Py_BuildValue("(in)", slot, slot >= 0 ? d : (Py_ssize_t)0);
fail:
    if (k.walk.found != found_stack)
        PyMem_Free(k.walk.found);
    hashes_close(&hb);
    return result;
}

PyObject *Index_pick_kv(Index *self, PyObject *const *args, Py_ssize_t nargs)
{
    return pick_kv_impl(self, args, nargs, 0);
}

PyObject *Index_pick_kv_claim(Index *self, PyObject *const *args, Py_ssize_t nargs)
{
    return pick_kv_impl(self, args, nargs, 1);
}

/* commit_routed(row, hashes, start, slot) -> blocks marked | None (generation changed: remap).
 * The routed bits a pick_kv_claim left: slot's bit, stamped now, on hashes [start, n), as
 * pick_kv sets them. Nothing when slot is no longer present (removed since the pick: its bits
 * would only mislead the slot's next server). */
PyObject *Index_commit_routed(Index *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    int64_t row, start, server;
    uint64_t *found_stack[FOUND_STACK];
    Hashes hb = {0};
    Walk w = {.found = found_stack};
    Config c;
    Py_ssize_t marked = 0;
    if (!nargs_ok("commit_routed", nargs, 4) || !arg_i64(args[0], &row) || !ix_ok(self, 1) ||
        own_row(self->ctl, row, 0) == NULL || !hashes_open(args[1], &hb) ||
        !arg_range(args[2], 0, hb.n, "start", &start) || !arg_slot(self->ctl, args[3], &server) ||
        !config_for_pick(self->ctl, &c))
        goto fail;
    if (stale(self)) {
        result = Py_NewRef(Py_None);
        goto fail;
    }
    if (start < hb.n && (c.present.w[server >> 6] >> (server & 63) & 1)) {
        if (hb.n > FOUND_STACK && (w.found = PyMem_Malloc((size_t)hb.n * sizeof(uint64_t *))) == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        memset(w.found, 0, (size_t)hb.n * sizeof(uint64_t *));
        w.ix = self;
        w.h = hb.h;
        w.n = hb.n;
        marked = self->nw == 1 ? commit_routed(self, &w, start, (int)server, 1)
                               : commit_routed(self, &w, start, (int)server, self->nw);
    }
    result = PyLong_FromSsize_t(marked);
fail:
    if (w.found != found_stack)
        PyMem_Free(w.found);
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
    int jump = 0, nw, n, slots[MAX_SERVERS_LIMIT];
    uint64_t *found_stack[FOUND_STACK];
    Config c;
    Set cand;
    Py_ssize_t depth[MAX_SERVERS_LIMIT];
    Walk w = {.found = found_stack};
    if (nargs < 1 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "match(hashes, role=-1, jump=False)");
        goto fail;
    }
    if ((nargs >= 2 && !arg_range(args[1], -1, MAX_ROLES - 1, "role", &role)) ||
        (nargs == 3 && (jump = PyObject_IsTrue(args[2])) < 0) || !ix_ok(self, 0) ||
        !hashes_open(args[0], &hb) || !config_for_pick(self->ctl, &c))
        goto fail;
    if (stale(self)) {
        result = Py_NewRef(Py_None);
        goto fail;
    }
    nw = self->nw;
    for (int i = 0; i < nw; i++)
        cand.w[i] = c.present.w[i] & c.healthy.w[i] & (role >= 0 ? c.role[role].w[i] : ~0ULL);
    if (!jump) {
        walk_prefix(self, hb.h, hb.n, &cand, KIND_BLOCK, 0, depth);
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
        w.words = set_words(&cand, nw);
        if (nw == 1)
            jump_walk(&w, cand, depth, NULL, 1);
        else
            jump_walk(&w, cand, depth, NULL, nw);
    }
    if ((result = PyList_New(0)) == NULL)
        goto fail;
    n = set_slots(&cand, nw, slots);
    for (int j = 0; j < n; j++) {
        if ((item = Py_BuildValue("(in)", slots[j], depth[slots[j]])) == NULL ||
            PyList_Append(result, item) < 0) {
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
 * Sticky by conversation across every worker: the first decider's CAS 0 -> server + 1 wins; a
 * session whose server is no longer a candidate is re-routed by CAS-replacing its value; new
 * sessions go to the candidate with the fewest active tokens. The session's stamp (which also
 * marks the slot a session, before its value is set) is refreshed on each use. */
PyObject *Index_conv_pick_explicit(Index *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    int64_t role, tokens;
    uint64_t conv, *s, r;
    Set cand;
    int slot = -1, nw, cur;
    char *p;
    if (!nargs_ok("conv_pick_explicit", nargs, 5) || (p = pick_head(self, args, &role, &cand)) == NULL ||
        !arg_u64(args[3], &conv) || !arg_range(args[4], 0, INT64_MAX, "num_tokens", &tokens))
        goto fail;
    if (stale(self)) {
        result = Py_NewRef(Py_None);
        goto fail;
    }
    nw = self->nw;
    if (set_any(&cand, nw)) {
        s = ix_upsert(self, key_of(conv, KIND_CONV, (int)role), 1);
        if (s != NULL)
            ST(&s[SL_TS(nw)], (monotonic_ns() & TS_MASK) | KIND_CONV << TS_KIND_SHIFT);
        for (int tries = 0; s != NULL && slot < 0 && tries < CLAIM_TRIES; tries++) {
            r = LDA(&s[SL_RT(0)]);
            cur = session_server(r, nw);
            if (set_has(&cand, nw, cur)) {
                slot = cur; /* sticky */
            } else {
                int w = least_tokens(self->ctl, &cand, (int)role);
                if (w < 0)
                    goto fail;
                if (__atomic_compare_exchange_n(&s[SL_RT(0)], &r, (uint64_t)w + 1, 0, __ATOMIC_ACQ_REL,
                                                __ATOMIC_RELAXED))
                    slot = w;
            }
        }
        if (slot < 0 && (slot = least_tokens(self->ctl, &cand, (int)role)) < 0)
            goto fail; /* full index (counted) or an endless CAS fight: not sticky this time */
        row_add_pick(self->ctl, p, slot, tokens);
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
    uint64_t now, *s;
    Set cand, deepest = {{0}};
    Py_ssize_t depth[MAX_SERVERS_LIMIT], dmax = 0;
    double threshold;
    int slot = -1, nw, n, slots[MAX_SERVERS_LIMIT];
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
    nw = self->nw;
    if (set_any(&cand, nw)) {
        walk_prefix(self, hb.h, hb.n, &cand, KIND_IMPL, (int)role, depth);
        n = set_slots(&cand, nw, slots);
        for (int j = 0; j < n; j++) {
            int sl = slots[j];
            if (depth[sl] > dmax) {
                dmax = depth[sl];
                memset(&deepest, 0, sizeof deepest);
            }
            if (depth[sl] == dmax)
                deepest.w[sl >> 6] |= 1ULL << (sl & 63);
        }
        if (!(hb.n > 0 && dmax > 0 && (double)dmax / (double)hb.n >= threshold))
            deepest = cand;
        if ((slot = least_tokens(self->ctl, &deepest, (int)role)) < 0)
            goto fail;
        now = monotonic_ns();
        for (Py_ssize_t j = 0; j < hb.n; j++) {
            if ((s = ix_upsert(self, key_of(hb.h[j], KIND_IMPL, (int)role), 1)) == NULL)
                break;
            routed_set(s, slot, now, KIND_IMPL, nw);
        }
        row_add_pick(self->ctl, p, slot, tokens);
    }
    result = Py_BuildValue("(in)", slot, slot >= 0 ? depth[slot] : (Py_ssize_t)0);
fail:
    hashes_close(&hb);
    return result;
}
