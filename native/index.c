/*
 * The KV block index: one `Index` wraps one mapped index segment "/{prefix}-idx-{generation:x}"
 * and the control `Region` whose configuration, worker rows and publication it routes with.
 *
 * Table: open addressing, linear probing from a key's home (Fibonacci hashing), slots {key,
 * event_mask, routed_mask, routed_ts} (32 bytes) where the control segment has 64 servers, with
 * nw = max_servers / 64 words per mask where it has more ({key, (event, routed) x nw, ts}: 80
 * bytes for 256); key 0 is EMPTY (a hash equal to 0 is stored as 1).
 * Keys go 0 -> K once by CAS and never move or change inside a generation, so a reader that
 * finds K reads that key's masks, and a key present when a probe starts cannot be missed.
 *
 * Writers (native/README.md, "Index concurrency"):
 * - event_mask: the coordinator only, from KV events (relaxed load + release store).
 * - keys: any process, by CAS (workers insert the blocks they route; the coordinator inserts
 *   stored blocks). A loser re-checks the slot's key, so a key is never inserted twice.
 * - routed_mask: workers fetch_or their chosen server's bit; the coordinator clears bits with
 *   fetch_and / CAS (removed events, cleared servers, the TTL sweep, LRU eviction).
 * - routed_ts: CLOCK_MONOTONIC ns of the last routing, in bits 0..61; bits 62..63 tell the
 *   slot's kind: 0 KV block, 1 explicit conversation session, 2 implicit conversation prefix.
 * - header: max_probe (CAS-max, raised before the key CAS), used (fetch_add reservation that
 *   bounds the load factor: an insert past insert_limit is refused and counted, never stored).
 *
 * Conversation keys are the caller's key mixed with a per-kind, per-role namespace constant, so
 * they never share a slot with a block hash in practice (64-bit hashes; a collision only blurs
 * one routing decision). The GIL is released only for whole-table loops (sweep, copy).
 */
#include "index.h"

#include <math.h>

/* ---- inserts ---------------------------------------------------------------------------- */

/* Reservations: `used` counts keys stored plus reservations, and no reservation is granted past
 * insert_limit, so a generation never holds more keys than its limit. A Budget of NULL reserves
 * one slot per insert. */
void budget_take(Index *ix, Budget *b, uint64_t want)
{
    uint64_t *used = hdr(ix, X_USED), old = ADD(used, want), ok;
    ok = old >= ix->limit ? 0 : ix->limit - old < want ? ix->limit - old : want;
    if (ok < want)
        ADD(used, (uint64_t)0 - (want - ok));
    b->left = ok;
}

void budget_return(Index *ix, Budget *b)
{
    if (b->left > 0)
        ADD(hdr(ix, X_USED), (uint64_t)0 - b->left);
    b->left = 0;
}

static int reserve_one(Index *ix, Budget *b)
{
    if (b != NULL) {
        if (b->left == 0)
            return 0;
        b->left--;
        return 1;
    }
    if (ADD(hdr(ix, X_USED), 1) >= ix->limit) {
        ADD(hdr(ix, X_USED), (uint64_t)-1);
        return 0;
    }
    return 1;
}

static void unreserve_one(Index *ix, Budget *b)
{
    if (b != NULL)
        b->left++;
    else
        ADD(hdr(ix, X_USED), (uint64_t)-1);
}

/* The slot holding `key`, inserting it by CAS if absent; NULL (counted when `count`) when the
 * index is full. Probes past max_probe until an EMPTY slot: the first EMPTY slot of a key's
 * probe sequence is the same for every racing inserter, so the CAS loser finds the winner's key
 * there, and a key is never stored twice. */
uint64_t *ix_upsert_b(Index *ix, uint64_t key, int count, Budget *b)
{
    uint64_t home = home_of(ix, key), *s, k, expected, *mp = hdr(ix, X_MAXPROBE), cur;
    int reserved = 0;
    for (uint64_t d = 0; d < ix->cap; d++) {
        s = slot_at(ix, home + d);
        k = LDA(&s[SL_KEY]);
        if (k == key)
            goto found;
        if (k != 0)
            continue;
        if (!reserved && !(reserved = reserve_one(ix, b)))
            break; /* full: refuse, never store past the limit */
        cur = LD(mp); /* raise max_probe before the key becomes visible */
        while (cur < d && !__atomic_compare_exchange_n(mp, &cur, d, 1, __ATOMIC_RELEASE,
                                                       __ATOMIC_RELAXED))
            ;
        expected = 0;
        if (__atomic_compare_exchange_n(&s[SL_KEY], &expected, key, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
            return s;
        if (expected == key)
            goto found; /* lost the race to the same key */
    }
    if (reserved)
        unreserve_one(ix, b);
    if (count)
        count_full(ix);
    return NULL;
found:
    if (reserved)
        unreserve_one(ix, b);
    return s;
}

/* ---- lifecycle -------------------------------------------------------------------------- */

static int Index_init(Index *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"buffer", "control", "writable", NULL};
    PyObject *buffer = NULL, *control = NULL;
    int writable = 1, rc = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!|p:Index", kwlist, &buffer, &RegionType,
                                     &control, &writable))
        goto fail;
    if (self->has_view) {
        PyErr_SetString(PyExc_TypeError, "Index is already initialised");
        goto fail;
    }
    if (!need_ready((Region *)control, 0))
        goto fail;
    if (PyObject_GetBuffer(buffer, &self->view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        goto fail;
    self->has_view = 1;
    if (((uintptr_t)self->view.buf & 7) != 0) {
        PyErr_SetString(PyExc_ValueError, "buffer is not 8-byte aligned");
        PyBuffer_Release(&self->view);
        self->has_view = 0;
        goto fail;
    }
    self->writable = writable;
    self->base = self->view.buf;
    self->len = (size_t)self->view.len;
    self->ctl = (Region *)Py_NewRef(control);
    rc = 0;
fail:
    return rc;
}

static int index_drop(Index *self)
{
    if (self->busy > 0) {
        PyErr_SetString(ShmError, "index is in use by a call running in another thread");
        return 0;
    }
    if (self->has_view) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
    }
    self->ready = 0;
    self->base = NULL;
    self->slots = NULL;
    self->len = 0;
    Py_CLEAR(self->ctl);
    return 1;
}

static void Index_dealloc(Index *self)
{
    self->busy = 0; /* no thread can hold a reference we are deallocating */
    index_drop(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Index_release(Index *self, PyObject *unused)
{
    return index_drop(self) ? Py_NewRef(Py_None) : NULL;
}

/* Usable for reads (write 0), slot writes (1), or coordinator writes to the control metrics (2). */
int ix_ok(Index *self, int write)
{
    int ok = 0;
    if (!self->has_view)
        PyErr_SetString(PyExc_ValueError, "index is released");
    else if (!self->ready)
        PyErr_SetString(ShmError, "index is not a validated segment: call check_index()");
    else if (write && !self->writable)
        PyErr_SetString(ShmError, "index is read-only");
    else if (self->nw != self->ctl->nw) /* the control region was re-made under us */
        PyErr_SetString(ShmError, "index and control segment disagree on max_servers");
    else
        ok = need_ready(self->ctl, write >= 2);
    return ok;
}

static void set_geometry(Index *self, uint64_t gen, unsigned log2, uint64_t limit, int nw)
{
    self->nw = nw;
    self->sw = SLOT_WORDS(nw);
    self->generation = gen;
    self->cap = 1ULL << log2;
    self->mask = self->cap - 1;
    self->shift = 64 - log2;
    self->limit = limit < self->cap ? limit : self->cap - 1; /* always one EMPTY slot left */
    self->slots = (uint64_t *)(self->base + IX_HEADER_BYTES);
    self->ready = 1;
}

static size_t index_size_for(unsigned log2, int nw) { return IX_HEADER_BYTES + ((size_t)ix_slot_bytes(nw) << log2); }

/* init_index(generation, cap_log2, insert_limit, created_wall_ns) -> segment_bytes: zero and
 * initialise a fresh segment in state BUILDING (publish() makes it PUBLISHED). */
static PyObject *Index_init_index(Index *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    int64_t log2, limit;
    uint64_t gen, wall;
    size_t need;
    int nw;
    if (!nargs_ok("init_index", nargs, 4) || !arg_u64(args[0], &gen) ||
        !arg_range(args[1], IX_MIN_LOG2, IX_MAX_LOG2, "cap_log2", &log2) ||
        !arg_range(args[2], 1, INT64_MAX, "insert_limit", &limit) || !arg_u64(args[3], &wall))
        goto fail;
    if (!self->has_view || !self->writable || self->busy) {
        PyErr_SetString(ShmError, "init_index needs a writable, unreleased, idle index");
        goto fail;
    }
    if (gen == 0) {
        PyErr_SetString(PyExc_ValueError, "generation must be > 0");
        goto fail;
    }
    if (!need_ready(self->ctl, 0))
        goto fail;
    nw = self->ctl->nw;
    need = index_size_for((unsigned)log2, nw);
    if (self->len < need) {
        PyErr_Format(SegmentFull, "mapping is %zu bytes; 2**%lld slots of %u bytes need %zu", self->len,
                     (long long)log2, ix_slot_bytes(nw), need);
        goto fail;
    }
    ST(hdr(self, X_STATE), STATE_BUILDING);
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    memset(self->base + 8, 0, need - 8);
    Py_END_ALLOW_THREADS
    self->busy--;
    ST(hdr(self, X_VERSION), (uint64_t)IX_VERSION | ((uint64_t)IX_HEADER_BYTES << 32));
    ST(hdr(self, X_GEN), gen);
    ST(hdr(self, X_CAPLOG), (uint64_t)log2 | ((uint64_t)ix_slot_bytes(nw) << 32));
    ST(hdr(self, X_SEGBYTES), (uint64_t)need);
    ST(hdr(self, X_CREATED), wall);
    set_geometry(self, gen, (unsigned)log2, (uint64_t)limit, nw);
    ST(hdr(self, X_LIMIT), self->limit);
    STR(hdr(self, X_MAGIC), IX_MAGIC);
    result = PyLong_FromSize_t(need);
fail:
    return result;
}

/* check_index() -> True when valid and PUBLISHED (or RETIRED), False while BUILDING;
 * LayoutMismatch when the header is not this build's index layout. */
static PyObject *Index_check_index(Index *self, PyObject *unused)
{
    PyObject *result = NULL;
    uint64_t magic, ver, gen, caplog, segbytes, limit, state;
    unsigned log2, slot_bytes;
    int nw;
    if (!self->has_view) {
        PyErr_SetString(PyExc_ValueError, "index is released");
        goto fail;
    }
    if (!need_ready(self->ctl, 0))
        goto fail;
    nw = self->ctl->nw;
    slot_bytes = ix_slot_bytes(nw);
    if (self->len < IX_HEADER_BYTES) {
        PyErr_Format(LayoutMismatch, "index mapping is %zu bytes, smaller than its %u-byte header",
                     self->len, IX_HEADER_BYTES);
        goto fail;
    }
    state = LDA(hdr(self, X_STATE));
    magic = LD(hdr(self, X_MAGIC));
    ver = LD(hdr(self, X_VERSION));
    gen = LD(hdr(self, X_GEN));
    caplog = LD(hdr(self, X_CAPLOG));
    segbytes = LD(hdr(self, X_SEGBYTES));
    limit = LD(hdr(self, X_LIMIT));
    log2 = (unsigned)(caplog & 0xFFFFFFFFu);
    if (state == STATE_BUILDING) {
        result = Py_NewRef(Py_False);
    } else if (magic != IX_MAGIC) {
        PyErr_SetString(LayoutMismatch, "bad magic (expected \"SDSGIDX1\"): not a shmdisagg index");
    } else if ((uint32_t)ver != IX_VERSION || (ver >> 32) != IX_HEADER_BYTES) {
        PyErr_Format(LayoutMismatch, "index layout version %u / header %u, but this build reads "
                     "version %u / header %u", (unsigned)(uint32_t)ver, (unsigned)(ver >> 32),
                     IX_VERSION, IX_HEADER_BYTES);
    } else if (state > STATE_RETIRED) {
        PyErr_Format(LayoutMismatch, "index state is %llu (expected 0..2)", (unsigned long long)state);
    } else if (log2 < IX_MIN_LOG2 || log2 > IX_MAX_LOG2) {
        PyErr_Format(LayoutMismatch, "index cap_log2 %u out of range", log2);
    } else if ((caplog >> 32) != slot_bytes) {
        PyErr_Format(LayoutMismatch, "index slot_bytes %u, but the control segment's %u servers need "
                     "%u-byte slots", (unsigned)(caplog >> 32), self->ctl->max_servers, slot_bytes);
    } else if (gen == 0 || segbytes < index_size_for(log2, nw) || segbytes > self->len) {
        PyErr_Format(LayoutMismatch, "index generation %llu, segment_bytes %llu: need %zu, mapped %zu",
                     (unsigned long long)gen, (unsigned long long)segbytes, index_size_for(log2, nw),
                     self->len);
    } else if (limit == 0 || limit >= (1ULL << log2)) {
        PyErr_Format(LayoutMismatch, "index insert_limit %llu out of range", (unsigned long long)limit);
    } else {
        set_geometry(self, gen, log2, limit, nw);
        result = Py_NewRef(Py_True);
    }
fail:
    return result;
}

static PyObject *set_state(Index *self, uint64_t state)
{
    PyObject *result = NULL;
    if (ix_ok(self, 1)) {
        STR(hdr(self, X_STATE), state);
        result = Py_NewRef(Py_None);
    }
    return result;
}

static PyObject *Index_publish(Index *self, PyObject *unused) { return set_state(self, STATE_PUBLISHED); }
static PyObject *Index_retire(Index *self, PyObject *unused) { return set_state(self, STATE_RETIRED); }

/* observe(row) -> bool: record this generation in the own row (observed_idx_gen). */
static PyObject *Index_observe(Index *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    int64_t row;
    char *p;
    if (!nargs_ok("observe", nargs, 1) || !arg_i64(args[0], &row) || !ix_ok(self, 0))
        goto fail;
    p = own_row(self->ctl, row, 1);
    if (p == NULL && PyErr_Occurred())
        goto fail;
    if (p != NULL)
        ST((uint64_t *)(p + W_IDXGEN), self->generation);
    result = Py_NewRef(p != NULL ? Py_True : Py_False);
fail:
    return result;
}

/* ---- arguments -------------------------------------------------------------------------- */


int hashes_open(PyObject *o, Hashes *hb)
{
    memset(hb, 0, sizeof *hb);
    if (PyBytes_Check(o)) {
        hb->h = (const uint64_t *)PyBytes_AS_STRING(o);
        hb->n = PyBytes_GET_SIZE(o) / 8;
        if (PyBytes_GET_SIZE(o) % 8 == 0)
            return 1;
    } else if (PyObject_GetBuffer(o, &hb->view, PyBUF_C_CONTIGUOUS) == 0) {
        hb->has_view = 1;
        hb->h = hb->view.buf;
        hb->n = hb->view.len / 8;
        if (hb->view.len % 8 == 0 && ((uintptr_t)hb->h & 7) == 0)
            return 1;
        PyBuffer_Release(&hb->view);
        hb->has_view = 0;
    } else {
        PyErr_Clear();
    }
    PyErr_SetString(PyExc_TypeError, "hashes must be bytes (or an aligned buffer) of packed "
                    "little-endian u64, a multiple of 8 bytes");
    return 0;
}

void hashes_close(Hashes *hb)
{
    if (hb->has_view)
        PyBuffer_Release(&hb->view);
    hb->has_view = 0;
}

int arg_double(PyObject *o, const char *what, double *out)
{
    *out = PyFloat_AsDouble(o);
    if (*out == -1.0 && PyErr_Occurred())
        return 0;
    if (isnan(*out)) {
        PyErr_Format(PyExc_ValueError, "%s must not be NaN", what);
        return 0;
    }
    return 1;
}

/* ---- coordinator: KV events ------------------------------------------------------------- */

static void metric_add(Region *r, int which, uint64_t n)
{
    uint64_t *w = U64(r, IM_WORD(which));
    ST(w, LD(w) + n);
}

/* The lag histogram's bucket of a lag in ns (see OFF_LAGHIST): 0..255. */
static unsigned lag_bucket(uint64_t lag)
{
    unsigned msb;
    if (lag < 4)
        return (unsigned)lag;
    msb = 63u - (unsigned)__builtin_clzll(lag);
    return 4u * msb + (unsigned)((lag >> (msb - 2)) & 3u);
}

static void record_lag(Region *r, uint64_t event_ts_ns)
{
    uint64_t now = realtime_ns(), lag = now > event_ts_ns ? now - event_ts_ns : 0, *w;
    w = U64(r, OFF_LAGHIST + 8 * lag_bucket(lag));
    ST(w, LD(w) + 1);
    metric_add(r, IM_LAG_SAMPLES, 1);
    metric_add(r, IM_LAG_SUM_NS, lag);
}

static int event_args(Index *self, const char *fn, PyObject *const *args, Py_ssize_t nargs,
                      Py_ssize_t want, int64_t *slot, Hashes *hb)
{
    return nargs_ok(fn, nargs, want) && ix_ok(self, 2) && arg_slot(self->ctl, args[0], slot) &&
           hashes_open(args[1], hb);
}

/* apply_stored(slot, hashes, event_ts_ns) -> blocks marked: set slot's event bit on every hash
 * (inserting absent keys). event_ts_ns: the executor's wall-clock time of the event, 0 if unknown;
 * it feeds the event-to-visibility lag histogram. */
static PyObject *Index_apply_stored(Index *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    int64_t slot;
    uint64_t ts, bit, *s, e, keys[PREFETCH];
    Py_ssize_t marked = 0;
    int ew;
    Hashes hb;
    if (!event_args(self, "apply_stored", args, nargs, 3, &slot, &hb))
        goto fail;
    if (!arg_u64(args[2], &ts)) {
        hashes_close(&hb);
        goto fail;
    }
    bit = 1ULL << (slot & 63);
    ew = SL_EV((int)(slot >> 6));
    for (Py_ssize_t j = 0; j < hb.n && j < PREFETCH; j++)
        prefetch_key(self, keys[j] = key_of(hb.h[j], KIND_BLOCK, 0));
    for (Py_ssize_t j = 0; j < hb.n; j++) {
        uint64_t key = keys[j & (PREFETCH - 1)];
        if (j + PREFETCH < hb.n)
            prefetch_key(self, keys[j & (PREFETCH - 1)] = key_of(hb.h[j + PREFETCH], KIND_BLOCK, 0));
        if ((s = ix_upsert(self, key, 1)) == NULL)
            continue;
        e = LD(&s[ew]);
        if (!(e & bit))
            STR(&s[ew], e | bit);
        marked++;
    }
    metric_add(self->ctl, IM_EVENTS, 1);
    metric_add(self->ctl, IM_BLOCKS, (uint64_t)hb.n);
    metric_add(self->ctl, IM_STORED, (uint64_t)hb.n);
    if (ts != 0)
        record_lag(self->ctl, ts);
    hashes_close(&hb);
    result = PyLong_FromSsize_t(marked);
fail:
    return result;
}

/* apply_removed(slot, hashes) -> blocks found: clear slot's event and routed bits on each. */
static PyObject *Index_apply_removed(Index *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    int64_t slot;
    uint64_t bit, *s, e, maxp, keys[PREFETCH];
    Py_ssize_t found = 0;
    int ew, rw;
    Hashes hb;
    if (!event_args(self, "apply_removed", args, nargs, 2, &slot, &hb))
        goto fail;
    bit = 1ULL << (slot & 63);
    ew = SL_EV((int)(slot >> 6));
    rw = SL_RT((int)(slot >> 6));
    maxp = max_probe(self);
    for (Py_ssize_t j = 0; j < hb.n && j < PREFETCH; j++)
        prefetch_key(self, keys[j] = key_of(hb.h[j], KIND_BLOCK, 0));
    for (Py_ssize_t j = 0; j < hb.n; j++) {
        uint64_t key = keys[j & (PREFETCH - 1)];
        if (j + PREFETCH < hb.n)
            prefetch_key(self, keys[j & (PREFETCH - 1)] = key_of(hb.h[j + PREFETCH], KIND_BLOCK, 0));
        if ((s = ix_find(self, key, maxp)) == NULL)
            continue;
        found++;
        e = LD(&s[ew]);
        if (e & bit)
            STR(&s[ew], e & ~bit);
        if (LD(&s[rw]) & bit)
            __atomic_fetch_and(&s[rw], ~bit, __ATOMIC_RELAXED);
    }
    metric_add(self->ctl, IM_EVENTS, 1);
    metric_add(self->ctl, IM_BLOCKS, (uint64_t)hb.n);
    metric_add(self->ctl, IM_REMOVED, (uint64_t)hb.n);
    hashes_close(&hb);
    result = PyLong_FromSsize_t(found);
fail:
    return result;
}

/* Clear server `server` in every slot of the given kinds (bitmask of 1 << kind); returns slots
 * changed. A session naming it is emptied by CAS (a decider that moved it meanwhile wins). Runs
 * with the GIL held: it writes event masks, whose single writer is the coordinator thread. */
static Py_ssize_t clear_server_bits(Index *self, int server, unsigned kinds)
{
    Py_ssize_t changed = 0;
    uint64_t *s, e, r, kind, bit = 1ULL << (server & 63);
    int nw = self->nw, ew = SL_EV(server >> 6), rw = SL_RT(server >> 6);
    for (uint64_t i = 0; i < self->cap; i++) {
        s = self->slots + i * self->sw;
        if (LD(&s[SL_KEY]) == 0 || !(kinds & (1u << (kind = LD(&s[SL_TS(nw)]) >> TS_KIND_SHIFT))))
            continue;
        if (kind == KIND_CONV) {
            r = LD(&s[SL_RT(0)]);
            changed += session_server(r, nw) == server &&
                       __atomic_compare_exchange_n(&s[SL_RT(0)], &r, 0, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
            continue;
        }
        e = LD(&s[ew]);
        r = LD(&s[rw]);
        if (e & bit)
            STR(&s[ew], e & ~bit);
        if (r & bit)
            __atomic_fetch_and(&s[rw], ~bit, __ATOMIC_RELAXED);
        changed += ((e | r) & bit) != 0;
    }
    return changed;
}

static PyObject *clear_common(Index *self, PyObject *const *args, Py_ssize_t nargs, const char *fn,
                              unsigned kinds)
{
    PyObject *result = NULL;
    int64_t slot;
    if (!nargs_ok(fn, nargs, 1) || !ix_ok(self, 2) || !arg_slot(self->ctl, args[0], &slot))
        goto fail;
    result = PyLong_FromSsize_t(clear_server_bits(self, (int)slot, kinds));
    metric_add(self->ctl, IM_CLEARED, 1);
fail:
    return result;
}

/* apply_all_cleared(slot) -> slots changed: the executor dropped every cached block. */
static PyObject *Index_apply_all_cleared(Index *self, PyObject *const *args, Py_ssize_t nargs)
{
    return clear_common(self, args, nargs, "apply_all_cleared", 1u << KIND_BLOCK);
}

/* clear_server(slot) -> slots changed: a removed or unhealthy server, or a reused slot: its bit
 * leaves every block and every conversation session (which then re-route). */
static PyObject *Index_clear_server(Index *self, PyObject *const *args, Py_ssize_t nargs)
{
    return clear_common(self, args, nargs, "clear_server",
                        1u << KIND_BLOCK | 1u << KIND_CONV | 1u << KIND_IMPL);
}

/* ---- coordinator: sweep, copy, scan ----------------------------------------------------- */

typedef struct {
    uint64_t used, live, dead, sessions, implicit, expired, evicted;
} Census;

/* k-th smallest (0-based) of a[0..n) by quickselect; reorders a. */
static uint64_t kth_smallest(uint64_t *a, size_t n, size_t k)
{
    size_t lo = 0, hi = n - 1;
    while (lo < hi) {
        uint64_t pivot = a[lo + (hi - lo) / 2], t;
        size_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] < pivot)
                i++;
            while (a[j] > pivot)
                j--;
            if (i <= j) {
                t = a[i], a[i] = a[j], a[j] = t;
                i++;
                if (j == 0)
                    break;
                j--;
            }
        }
        if (k <= j)
            hi = j;
        else if (k >= i)
            lo = i;
        else
            break;
    }
    return a[k];
}

/* Evict the `excess` oldest entries of `kind` (mask CAS'd to 0: a dead key): first every entry
 * stamped before the cutoff stamp, then entries at the cutoff until `excess` are gone. An entry
 * used meanwhile carries a newer stamp and survives. */
static uint64_t evict_oldest(Index *self, uint64_t kind, uint64_t *stamps, size_t n, size_t excess)
{
    uint64_t cutoff = kth_smallest(stamps, n, excess - 1), evicted = 0, *s, r, ts, t;
    int nw = self->nw, words = kind == KIND_CONV ? 1 : nw, gone;
    for (int pass = 0; pass < 2; pass++) {
        for (uint64_t i = 0; i < self->cap && evicted < excess; i++) {
            s = self->slots + i * self->sw;
            ts = LD(&s[SL_TS(nw)]);
            t = ts & TS_MASK;
            if (LD(&s[SL_KEY]) == 0 || (ts >> TS_KIND_SHIFT) != kind ||
                (pass == 0 ? t >= cutoff : t != cutoff))
                continue;
            gone = 0; /* a session is one word; an implicit entry's routed mask is nw words */
            for (int w = 0; w < words; w++) {
                r = LDA(&s[SL_RT(w)]);
                gone |= r != 0 && __atomic_compare_exchange_n(&s[SL_RT(w)], &r, 0, 0, __ATOMIC_RELAXED,
                                                               __ATOMIC_RELAXED);
            }
            evicted += (uint64_t)gone;
        }
    }
    return evicted;
}

static int sweep_scan(Index *self, uint64_t now, uint64_t ttl, uint64_t max_sessions,
                      uint64_t max_implicit, Census *c)
{
    uint64_t *s, k, r, e, ts, kind, rw[SW_MAX], *conv = NULL, *impl = NULL;
    size_t nconv = 0, nimpl = 0, capconv = 0, capimpl = 0;
    int ok = 1, nw = self->nw, expired;
    memset(c, 0, sizeof *c);
    for (uint64_t i = 0; i < self->cap && ok; i++) {
        s = self->slots + i * self->sw;
        if ((k = LDA(&s[SL_KEY])) == 0)
            continue;
        c->used++;
        /* the routed words (acquire) before the stamp: a bit seen comes with its fresh stamp */
        for (int w = 0; w < nw; w++)
            rw[w] = LDA(&s[SL_RT(w)]);
        ts = LD(&s[SL_TS(nw)]);
        kind = ts >> TS_KIND_SHIFT;
        r = e = 0;
        if (kind == KIND_BLOCK) {
            /* each routed word on its own: a routing that lands meanwhile wins its word's CAS */
            int old = ttl != 0 && now > (ts & TS_MASK) && now - (ts & TS_MASK) > ttl;
            expired = 0;
            for (int w = 0; w < nw; w++) {
                if (rw[w] != 0 && old &&
                    __atomic_compare_exchange_n(&s[SL_RT(w)], &rw[w], 0, 0, __ATOMIC_RELAXED,
                                                __ATOMIC_RELAXED)) {
                    expired = 1;
                    rw[w] = 0;
                }
                r |= rw[w];
                e |= LD(&s[SL_EV(w)]);
            }
            c->expired += (uint64_t)expired;
            if (r | e)
                c->live++;
            else
                c->dead++;
            continue;
        }
        for (int w = 0; w < (kind == KIND_CONV ? 1 : nw); w++)
            r |= rw[w];
        if (r == 0) {
            c->dead++;
        } else {
            uint64_t **arr = kind == KIND_CONV ? &conv : &impl;
            size_t *n = kind == KIND_CONV ? &nconv : &nimpl, *cap = kind == KIND_CONV ? &capconv : &capimpl;
            if (*n == *cap) {
                size_t want = *cap ? *cap * 2 : 4096;
                uint64_t *grown = PyMem_RawRealloc(*arr, want * sizeof(uint64_t));
                if (grown == NULL) {
                    ok = 0;
                    break;
                }
                *arr = grown;
                *cap = want;
            }
            (*arr)[(*n)++] = ts & TS_MASK;
            c->live++;
        }
    }
    c->sessions = nconv;
    c->implicit = nimpl;
    if (ok && nconv > max_sessions)
        c->evicted += evict_oldest(self, KIND_CONV, conv, nconv, nconv - max_sessions);
    if (ok && nimpl > max_implicit)
        c->evicted += evict_oldest(self, KIND_IMPL, impl, nimpl, nimpl - max_implicit);
    c->live -= c->evicted;
    c->dead += c->evicted;
    PyMem_RawFree(conv);
    PyMem_RawFree(impl);
    return ok;
}

static PyObject *census_dict(Census *c, uint64_t maxp, uint64_t used_hdr)
{
    return Py_BuildValue("{sKsKsKsKsKsKsKsKsK}", "used", (unsigned long long)c->used, "live",
                         (unsigned long long)c->live, "dead", (unsigned long long)c->dead,
                         "sessions", (unsigned long long)(c->sessions),
                         "implicit_entries", (unsigned long long)c->implicit, "routed_expired",
                         (unsigned long long)c->expired, "evicted", (unsigned long long)c->evicted,
                         "max_probe", (unsigned long long)maxp, "reserved",
                         (unsigned long long)used_hdr);
}

/* sweep(now_ns, routed_ttl_ns, max_sessions, max_implicit) -> census dict (coordinator):
 * clears block routed masks stamped more than routed_ttl_ns (0: never) before now_ns, evicts the
 * oldest sessions beyond max_sessions and implicit entries beyond max_implicit, counts, and
 * stores the counts in the control segment's index metrics. Releases the GIL on large tables. */
static PyObject *Index_sweep(Index *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    uint64_t now, ttl, maxs, maxi, maxp;
    Census c;
    int ok;
    if (!nargs_ok("sweep", nargs, 4) || !arg_u64(args[0], &now) || !arg_u64(args[1], &ttl) ||
        !arg_u64(args[2], &maxs) || !arg_u64(args[3], &maxi) || !ix_ok(self, 2))
        goto fail;
    self->busy++;
    if (self->cap >= NOGIL_SLOTS) {
        Py_BEGIN_ALLOW_THREADS
        ok = sweep_scan(self, now, ttl, maxs, maxi, &c);
        Py_END_ALLOW_THREADS
    } else {
        ok = sweep_scan(self, now, ttl, maxs, maxi, &c);
    }
    self->busy--;
    if (!ok) {
        PyErr_NoMemory();
        goto fail;
    }
    maxp = max_probe(self);
    if (need_ready(self->ctl, 1)) { /* the control segment may have been released meanwhile */
        ST(U64(self->ctl, IM_WORD(IM_LIVE)), c.live);
        ST(U64(self->ctl, IM_WORD(IM_DEAD)), c.dead);
        ST(U64(self->ctl, IM_WORD(IM_USED)), c.used);
        ST(U64(self->ctl, IM_WORD(IM_MAXPROBE)), maxp);
        ST(U64(self->ctl, IM_WORD(IM_SESSIONS)), c.sessions);
        ST(U64(self->ctl, IM_WORD(IM_IMPLICIT)), c.implicit);
        ST(U64(self->ctl, IM_WORD(IM_LAST_SWEEP_NS)), now);
        metric_add(self->ctl, IM_SWEEPS, 1);
        metric_add(self->ctl, IM_EXPIRED, c.expired);
        metric_add(self->ctl, IM_EVICTED, c.evicted);
        result = census_dict(&c, maxp, LD(hdr(self, X_USED)));
    }
fail:
    return result;
}

/* scan() -> census dict, read-only (nothing expires or is evicted), plus "server_blocks": per
 * server slot, how many block entries a KV event confirmed on it (a list of max_servers). */
static PyObject *Index_scan(Index *self, PyObject *unused)
{
    PyObject *result = NULL, *blocks = NULL;
    Census c;
    uint64_t *s, r, e, ts, per_server[MAX_SERVERS_LIMIT] = {0};
    int nw;
    if (!ix_ok(self, 0))
        goto fail;
    nw = self->nw;
    memset(&c, 0, sizeof c);
    for (uint64_t i = 0; i < self->cap; i++) {
        s = self->slots + i * self->sw;
        if (LDA(&s[SL_KEY]) == 0)
            continue;
        c.used++;
        ts = LD(&s[SL_TS(nw)]);
        r = e = 0;
        for (int w = 0; w < nw; w++) {
            uint64_t ew = (ts >> TS_KIND_SHIFT) == KIND_BLOCK ? LD(&s[SL_EV(w)]) : 0;
            r |= LD(&s[SL_RT(w)]);
            e |= ew;
            for (uint64_t m = ew; m != 0; m &= m - 1)
                per_server[64 * w + __builtin_ctzll(m)]++;
        }
        if (r | e) {
            c.live++;
            c.sessions += r && (ts >> TS_KIND_SHIFT) == KIND_CONV;
            c.implicit += r && (ts >> TS_KIND_SHIFT) == KIND_IMPL;
        } else {
            c.dead++;
        }
    }
    if ((result = census_dict(&c, max_probe(self), LD(hdr(self, X_USED)))) == NULL ||
        (blocks = PyList_New((Py_ssize_t)self->ctl->max_servers)) == NULL)
        goto fail;
    for (Py_ssize_t k = 0; k < (Py_ssize_t)self->ctl->max_servers; k++) {
        PyObject *n = PyLong_FromUnsignedLongLong(per_server[k]);
        if (n == NULL)
            goto fail;
        PyList_SET_ITEM(blocks, k, n);
    }
    if (PyDict_SetItemString(result, "server_blocks", blocks) < 0)
        goto fail;
    Py_DECREF(blocks);
    return result;
fail:
    Py_XDECREF(blocks);
    Py_XDECREF(result);
    return NULL;
}

/* Both generations have the same slot width (copy_into checks it). */
static uint64_t copy_live(Index *src, Index *dst, uint64_t *refused)
{
    uint64_t copied = 0, *s, *d, k, any, ts, r[SW_MAX], e[SW_MAX];
    int nw = src->nw;
    for (uint64_t i = 0; i < src->cap; i++) {
        s = src->slots + i * src->sw;
        if ((k = LDA(&s[SL_KEY])) == 0)
            continue;
        ts = LD(&s[SL_TS(nw)]);
        any = 0;
        for (int w = 0; w < nw; w++) {
            r[w] = LD(&s[SL_RT(w)]);
            e[w] = (ts >> TS_KIND_SHIFT) == KIND_BLOCK ? LD(&s[SL_EV(w)]) : 0;
            any |= r[w] | e[w];
        }
        if (any == 0)
            continue; /* dead keys are what compaction drops */
        if ((d = ix_upsert(dst, k, 0)) == NULL) {
            (*refused)++;
            continue;
        }
        for (int w = 0; w < nw; w++)
            ST(&d[SL_EV(w)], e[w]);
        ST(&d[SL_TS(nw)], ts);
        for (int w = 0; w < nw; w++)
            if (r[w] != 0)
                __atomic_fetch_or(&d[SL_RT(w)], r[w], __ATOMIC_RELEASE);
        copied++;
    }
    return copied;
}

/* copy_into(dst) -> (copied, refused): insert every live key of this generation, with its masks
 * and stamp, into `dst` (a BUILDING generation). Dead keys are dropped; keys that do not fit
 * are refused (counted as full drops). Releases the GIL on large tables. */
static PyObject *Index_copy_into(Index *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    Index *dst;
    uint64_t copied, refused = 0;
    if (!nargs_ok("copy_into", nargs, 1) || !ix_ok(self, 0))
        goto fail;
    if (!PyObject_TypeCheck(args[0], &IndexType) || args[0] == (PyObject *)self) {
        PyErr_SetString(PyExc_TypeError, "copy_into needs another Index");
        goto fail;
    }
    dst = (Index *)args[0];
    if (!ix_ok(dst, 2))
        goto fail;
    if (dst->nw != self->nw) {
        PyErr_SetString(PyExc_ValueError, "copy_into needs an index of the same slot width");
        goto fail;
    }
    self->busy++;
    dst->busy++;
    if (self->cap >= NOGIL_SLOTS) {
        Py_BEGIN_ALLOW_THREADS
        copied = copy_live(self, dst, &refused);
        Py_END_ALLOW_THREADS
    } else {
        copied = copy_live(self, dst, &refused);
    }
    self->busy--;
    dst->busy--;
    if (refused && need_ready(self->ctl, 0))
        ADD(U64(self->ctl, IC_FULL_DROPS), refused);
    PyErr_Clear();
    result = Py_BuildValue("(KK)", (unsigned long long)copied, (unsigned long long)refused);
fail:
    return result;
}

/* lookup(hash, kind=0, role=0) -> (event_mask, routed_mask, routed_ts_ns) or None. kind 1 looks
 * up a conversation key, kind 2 an implicit prefix hash (tests and diagnostics). */
static PyObject *Index_lookup(Index *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL, *e = NULL, *r = NULL;
    uint64_t h, *s;
    int64_t kind = 0, role = 0;
    Set ev, rt;
    if (nargs < 1 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "lookup(hash, kind=0, role=0)");
        goto fail;
    }
    if (!arg_u64(args[0], &h) || (nargs > 1 && !arg_range(args[1], 0, 2, "kind", &kind)) ||
        (nargs > 2 && !arg_range(args[2], 0, MAX_ROLES - 1, "role", &role)) || !ix_ok(self, 0))
        goto fail;
    s = ix_find(self, key_of(h, (uint64_t)kind, (int)role), max_probe(self));
    if (s == NULL) {
        result = Py_NewRef(Py_None);
        goto fail;
    }
    memset(&ev, 0, sizeof ev);
    memset(&rt, 0, sizeof rt);
    for (int w = 0; w < self->nw; w++) {
        ev.w[w] = LD(&s[SL_EV(w)]);
        rt.w[w] = LD(&s[SL_RT(w)]);
    }
    if ((LD(&s[SL_TS(self->nw)]) >> TS_KIND_SHIFT) == KIND_CONV) { /* a session: as the mask of its server */
        int server = session_server(rt.w[0], self->nw);
        memset(&rt, 0, sizeof rt);
        if (server >= 0)
            rt.w[server >> 6] = 1ULL << (server & 63);
    }
    if ((e = set_to_long(&ev, self->nw)) != NULL && (r = set_to_long(&rt, self->nw)) != NULL)
        result = Py_BuildValue("(OOK)", e, r, (unsigned long long)(LD(&s[SL_TS(self->nw)]) & TS_MASK));
fail:
    Py_XDECREF(e);
    Py_XDECREF(r);
    return result;
}

/* ---- type ------------------------------------------------------------------------------- */

static PyObject *Index_get(Index *self, void *closure)
{
    uintptr_t which = (uintptr_t)closure;
    uint64_t v = 0;
    if (self->ready && self->has_view) {
        switch (which) {
        case 0: v = self->generation; break;
        case 1: v = self->cap; break;
        case 2: v = self->limit; break;
        case 3: v = LD(hdr(self, X_USED)); break;
        case 4: v = max_probe(self); break;
        case 5: v = LDA(hdr(self, X_STATE)); break;
        default: break;
        }
    }
    return PyLong_FromUnsignedLongLong(v);
}

static PyObject *Index_get_size(Index *self, void *closure)
{
    return PyLong_FromSize_t(self->has_view ? self->len : 0);
}

#define IFAST(name, doc) {#name, (PyCFunction)(void (*)(void))Index_##name, METH_FASTCALL, doc}
#define INOARG(name, doc) {#name, (PyCFunction)(void (*)(void))Index_##name, METH_NOARGS, doc}

static PyMethodDef Index_methods[] = {
    INOARG(release, "Drop the buffer export and the control reference; unusable afterwards."),
    IFAST(init_index, "init_index(generation, cap_log2, insert_limit, created_wall_ns) -> bytes"),
    INOARG(check_index, "check_index() -> bool (False: still BUILDING); LayoutMismatch"),
    INOARG(publish, "publish(): state PUBLISHED (release store); then publish it in the control"),
    INOARG(retire, "retire(): state RETIRED"),
    IFAST(observe, "observe(row) -> bool: store this generation as the row's observed_idx_gen"),
    IFAST(apply_stored, "apply_stored(slot, hashes, event_ts_ns) -> blocks marked"),
    IFAST(apply_removed, "apply_removed(slot, hashes) -> blocks found"),
    IFAST(apply_all_cleared, "apply_all_cleared(slot) -> slots changed (blocks only)"),
    IFAST(clear_server, "clear_server(slot) -> slots changed (blocks and sessions)"),
    IFAST(sweep, "sweep(now_ns, routed_ttl_ns, max_sessions, max_implicit) -> census dict"),
    INOARG(scan, "scan() -> census dict (read-only)"),
    IFAST(copy_into, "copy_into(dst) -> (copied, refused): live keys into a BUILDING generation"),
    IFAST(lookup, "lookup(hash, kind=0, role=0) -> (event_mask, routed_mask, ts_ns) | None"),
    IFAST(pick_kv, "pick_kv(row, role, exclude, hashes, num_tokens, load_weight, load_cap, "
                   "use_tokens, track_routed[, max_batch_size[, pin_key]]) -> (slot, matched) | None"),
    IFAST(pick_kv_claim, "pick_kv_claim(pick_kv's 11 arguments, defer_min) -> (slot, matched, commit_from) | "
                         "None: routed bits on defer_min blocks or more are left to commit_routed"),
    IFAST(commit_routed, "commit_routed(row, hashes, start, slot) -> blocks marked | None"),
    IFAST(match, "match(hashes, role=-1) -> [(slot, depth)] | None"),
    IFAST(conv_pick_explicit, "conv_pick_explicit(row, role, exclude, conv_key, num_tokens) -> "
                              "slot | None"),
    IFAST(conv_pick_implicit, "conv_pick_implicit(row, role, exclude, hashes, num_tokens, "
                              "match_threshold) -> (slot, depth) | None"),
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Index_getset[] = {
    {"generation", (getter)Index_get, NULL, "generation (0 until validated)", (void *)0},
    {"capacity", (getter)Index_get, NULL, "slots", (void *)1},
    {"insert_limit", (getter)Index_get, NULL, "most keys the generation accepts", (void *)2},
    {"used", (getter)Index_get, NULL, "keys stored plus reservations in flight", (void *)3},
    {"max_probe", (getter)Index_get, NULL, "longest probe distance so far", (void *)4},
    {"state", (getter)Index_get, NULL, "0 building, 1 published, 2 retired", (void *)5},
    {"size", (getter)Index_get_size, NULL, "mapped length in bytes (0 once released)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmdisagg._native.Index",
    .tp_basicsize = sizeof(Index),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Index(buffer, control, writable=True): one mapped KV block index segment.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Index_init,
    .tp_dealloc = (destructor)Index_dealloc,
    .tp_methods = Index_methods,
    .tp_getset = Index_getset,
};

int index_add_constants(PyObject *m)
{
    PyObject *magic = PyLong_FromUnsignedLongLong(IX_MAGIC);
    int ok = magic != NULL && PyModule_AddObjectRef(m, "IX_MAGIC", magic) == 0;
    Py_XDECREF(magic);
#define ICONST(name) (ok = ok && PyModule_AddIntConstant(m, #name, (long)(name)) == 0)
    ICONST(IX_VERSION);
    ICONST(IX_HEADER_BYTES);
    ICONST(IX_SLOT_BYTES);
    ICONST(IX_MIN_LOG2);
    ICONST(IX_MAX_LOG2);
    ICONST(REFRESH_NS);
    ICONST(IX_JUMP);
#undef ICONST
    return ok;
}
