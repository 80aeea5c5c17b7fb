/*
 * shmdisagg._native: every shared-memory word access of shmdisagg goes through this file.
 *
 * One `Region` wraps one mapped control segment (any buffer: the mmap in production, a bytearray
 * in unit tests) and holds its Py_buffer export until release()/dealloc, so the mmap cannot be
 * closed under us. The layout is documented in native/README.md; the constants below are its
 * single source of truth (shmdisagg/shm/layout.py re-exports them).
 *
 * Rules (from the project's shared-memory design notes, not part of the repository):
 * - Shared words are naturally aligned 4/8-byte integers accessed only through GCC __atomic
 *   builtins; no 16-byte atomics anywhere (libatomic may use a process-local lock).
 * - Multi-word records are seqlocks in Boehm's fence form. Readers give up after SEQ_TRIES tries
 *   (a writer killed mid-write leaves the sequence odd forever) and raise RetryExhausted; picks
 *   fall back to the last config copy this Region read successfully.
 * - The mapped bytes are untrusted: the header is validated field by field against this build's
 *   layout, every header-derived size is clamped to the mapping, and every record pointer is
 *   bounds- and alignment-checked against the mapped length before use.
 * - The GIL is kept: every call is sub-microsecond (measured in the README).
 * - Every function has a single exit: errors `goto fail` with an exception set and `result`
 *   NULL; the success path falls through `fail:` with `result` set.
 *
 * This file holds the `Region` type and the module. hash.c and sha256.c compute block hashes,
 * hashcache.c caches them by prefix, index.c and picks.c hold the `Index` type over one KV block
 * index segment (native/README.md has the map).
 */
#include "_native.h"

PyObject *ShmError, *LayoutMismatch, *RetryExhausted, *SegmentFull, *RowLost;

static size_t control_size_for(uint32_t max_servers, uint32_t max_workers)
{
    return control_layout(max_servers, max_workers).bytes;
}

_Static_assert(RET_DISPATCHED + 8 <= HEADER_BYTES && H_CONFIG + 8 <= HEADER_BYTES, "header words");

/* max_servers as a call gives it: a multiple of 64 in 64..MAX_SERVERS_LIMIT (ValueError). */
static int arg_servers(PyObject *o, int64_t *out)
{
    int ok = arg_range(o, 64, MAX_SERVERS_LIMIT, "max_servers", out);
    if (ok && *out % 64 != 0) {
        PyErr_Format(PyExc_ValueError, "max_servers %lld is not a multiple of 64", (long long)*out);
        ok = 0;
    }
    return ok;
}

PyObject *set_to_long(const Set *s, int nw)
{
    if (nw == 1)
        return PyLong_FromUnsignedLongLong(s->w[0]);
#if PY_VERSION_HEX >= 0x030D0000
    return PyLong_FromUnsignedNativeBytes(s->w, 8 * (size_t)nw,
                                          Py_ASNATIVEBYTES_LITTLE_ENDIAN | Py_ASNATIVEBYTES_UNSIGNED_BUFFER);
#else
    return _PyLong_FromByteArray((const unsigned char *)s->w, 8 * (size_t)nw, 1, 0);
#endif
}

int need_ready(Region *r, int write)
{
    int ok = 0;
    if (!r->has_view)
        PyErr_SetString(PyExc_ValueError, "region is released");
    else if (!r->ready)
        PyErr_SetString(ShmError, "region is not a validated control segment: call check_control()");
    else if (write && !r->writable)
        PyErr_SetString(ShmError, "region is read-only");
    else
        ok = 1;
    return ok;
}

char *server_at(Region *r, int64_t slot)
{
    char *p = NULL;
    if (slot < 0 || slot >= (int64_t)r->max_servers) {
        PyErr_Format(PyExc_ValueError, "server slot %lld out of range 0..%u", (long long)slot,
                     r->max_servers - 1);
        goto fail;
    }
    p = at(r, r->off_servers + (size_t)slot * SERVER_STRIDE, SERVER_STRIDE, 128);
    if (p == NULL)
        PyErr_Format(LayoutMismatch, "server record %lld lies outside the mapping", (long long)slot);
fail:
    return p;
}

char *row_at(Region *r, int64_t row)
{
    char *p = NULL;
    if (row < 0 || row >= (int64_t)r->max_workers) {
        PyErr_Format(PyExc_ValueError, "worker row %lld out of range 0..%u", (long long)row,
                     r->max_workers - 1);
        goto fail;
    }
    p = at(r, r->off_workers + (size_t)row * r->worker_stride, r->worker_stride, 128);
    if (p == NULL)
        PyErr_Format(LayoutMismatch, "worker row %lld lies outside the mapping", (long long)row);
fail:
    return p;
}

/* The caller's own row: checked writable, in range, and still owned with the token this Region
 * claimed it with. Returns NULL with RowLost set (lost_ok == 0) or with no exception (lost_ok). */
char *own_row(Region *r, int64_t row, int lost_ok)
{
    char *p = NULL;
    if (!need_ready(r, 1) || (p = row_at(r, row)) == NULL)
        goto fail;
    if (r->tokens[row] == 0 || LD((uint64_t *)(p + W_TOKEN)) != r->tokens[row]) {
        p = NULL;
        if (!lost_ok)
            PyErr_Format(RowLost, "worker row %lld is not owned by this process (never claimed "
                         "here, or reclaimed by the coordinator): claim a new row", (long long)row);
    }
fail:
    return p;
}

uint32_t rows_in_use(Region *r)
{
    uint64_t hwm = LDA(U64(r, RL_HWM));
    return hwm < r->max_workers ? (uint32_t)hwm : r->max_workers;
}

/* ---- argument helpers ------------------------------------------------------------------- */

int nargs_ok(const char *fn, Py_ssize_t nargs, Py_ssize_t want)
{
    if (nargs != want)
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", fn, want, nargs);
    return nargs == want;
}

int arg_i64(PyObject *o, int64_t *out)
{
    long long v = PyLong_AsLongLong(o);
    *out = (int64_t)v;
    return !(v == -1 && PyErr_Occurred());
}

int arg_u64(PyObject *o, uint64_t *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    *out = (uint64_t)v;
    return !(v == (unsigned long long)-1 && PyErr_Occurred());
}

int arg_range(PyObject *o, int64_t lo, int64_t hi, const char *what, int64_t *out)
{
    int ok = arg_i64(o, out);
    if (ok && (*out < lo || *out > hi)) {
        PyErr_Format(PyExc_ValueError, "%s %lld out of range %lld..%lld", what, (long long)*out,
                     (long long)lo, (long long)hi);
        ok = 0;
    }
    return ok;
}

/* ---- lifecycle -------------------------------------------------------------------------- */

static int Region_init(Region *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"buffer", "writable", NULL};
    PyObject *buffer = NULL;
    int writable = 1, rc = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|p:Region", kwlist, &buffer, &writable))
        goto fail;
    if (self->has_view) {
        PyErr_SetString(PyExc_TypeError, "Region is already initialised");
        goto fail;
    }
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
    rc = 0;
fail:
    return rc;
}

static void region_drop(Region *self)
{
    if (self->has_view) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
    }
    self->ready = 0;
    self->base = NULL;
    self->len = 0;
    PyMem_Free(self->tokens);
    self->tokens = NULL;
}

static void Region_dealloc(Region *self)
{
    region_drop(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Region_release(Region *self, PyObject *unused)
{
    region_drop(self);
    Py_RETURN_NONE;
}

/* Marks the Region usable for `max_servers` servers and `max_workers` rows. Re-validating the
 * same layout keeps the tokens of rows this Region claimed. */
static int region_set_ready(Region *self, uint32_t max_servers, uint32_t max_workers)
{
    ControlLayout l = control_layout(max_servers, max_workers);
    if (self->tokens == NULL || self->max_workers != max_workers || self->max_servers != max_servers) {
        PyMem_Free(self->tokens);
        self->tokens = PyMem_Calloc(max_workers, sizeof(uint64_t));
        self->cfg_cached = self->cfg_stuck = 0;
    }
    self->max_workers = max_workers;
    self->max_servers = max_servers;
    self->nw = (int)(max_servers / 64u);
    self->off_config = l.off_config;
    self->off_retired = l.off_retired;
    self->off_servers = l.off_servers;
    self->off_workers = l.off_workers;
    self->worker_stride = l.worker_stride;
    self->w_tok = W_ACTIVE_REQ + 4u * (size_t)max_servers;
    self->w_routed = self->w_tok + 8u * (size_t)max_servers;
    self->ready = self->tokens != NULL;
    if (!self->ready)
        PyErr_NoMemory();
    return self->ready;
}

static PyObject *Region_init_control(Region *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    int64_t mw, ms = DEFAULT_MAX_SERVERS;
    uint64_t wall_ns;
    ControlLayout l;
    if (nargs != 2 && nargs != 3) {
        PyErr_Format(PyExc_TypeError, "init_control expected 2 or 3 arguments, got %zd", nargs);
        goto fail;
    }
    if (!arg_range(args[0], 1, MAX_WORKERS_LIMIT, "max_workers", &mw) || !arg_u64(args[1], &wall_ns) ||
        (nargs == 3 && !arg_servers(args[2], &ms)))
        goto fail;
    if (!self->has_view || !self->writable) {
        PyErr_SetString(ShmError, "init_control needs a writable, unreleased region");
        goto fail;
    }
    l = control_layout((uint32_t)ms, (uint32_t)mw);
    if (self->len < l.bytes) {
        PyErr_Format(SegmentFull, "mapping is %zu bytes; %lld servers and %lld worker rows need %zu",
                     self->len, (long long)ms, (long long)mw, l.bytes);
        goto fail;
    }
    /* Nobody trusts these bytes before the release store of init_state below (ordering rule O1). */
    ST(U64(self, H_INIT), 0);
    memset(self->base + 8, 0, l.bytes - 8);
    ST(U64(self, H_MAGIC), MAGIC);
    ST(U64(self, H_VERSION), (uint64_t)LAYOUT_VERSION | ((uint64_t)HEADER_BYTES << 32));
    ST(U64(self, H_SEGBYTES), (uint64_t)l.bytes);
    ST(U64(self, H_COUNTS), (uint64_t)ms | ((uint64_t)mw << 16));
    ST(U64(self, H_SERVERS), (uint64_t)l.off_servers | ((uint64_t)SERVER_STRIDE << 32));
    ST(U64(self, H_WORKERS), (uint64_t)l.off_workers | ((uint64_t)l.worker_stride << 32));
    ST(U64(self, H_CONFIG), (uint64_t)l.off_config | ((uint64_t)l.off_retired << 32));
    ST(U64(self, H_CREATED), wall_ns);
    STR(U64(self, H_INIT), (uint64_t)INIT_READY);
    PyMem_Free(self->tokens); /* a fresh segment: forget rows claimed in the old contents */
    self->tokens = NULL;
    if (!region_set_ready(self, (uint32_t)ms, (uint32_t)mw))
        goto fail;
    result = PyLong_FromSize_t(l.bytes);
fail:
    return result;
}

/* True: valid and READY (the Region is now usable). False: not READY yet (retry). Raises
 * LayoutMismatch when the header is READY but does not describe this build's layout. */
static PyObject *Region_check_control(Region *self, PyObject *unused)
{
    PyObject *result = NULL;
    uint64_t init, magic, ver, segbytes, counts, srv, wrk, cfg;
    uint32_t max_workers, max_servers;
    ControlLayout l;
    char hex[48]; /* PyErr_Format has no %llx on 3.11 */
    if (!self->has_view) {
        PyErr_SetString(PyExc_ValueError, "region is released");
        goto fail;
    }
    if (self->len < HEADER_BYTES) {
        PyErr_Format(LayoutMismatch, "mapping is %zu bytes, smaller than the %u-byte header",
                     self->len, HEADER_BYTES);
        goto fail;
    }
    init = LDA(U64(self, H_INIT));
    if (init == 0) {
        result = Py_NewRef(Py_False);
        goto fail;
    }
    magic = LD(U64(self, H_MAGIC));
    ver = LD(U64(self, H_VERSION));
    segbytes = LD(U64(self, H_SEGBYTES));
    counts = LD(U64(self, H_COUNTS));
    srv = LD(U64(self, H_SERVERS));
    wrk = LD(U64(self, H_WORKERS));
    cfg = LD(U64(self, H_CONFIG));
    max_workers = (uint32_t)((counts >> 16) & 0xFFFF);
    max_servers = (uint32_t)(counts & 0xFFFF);
    l = control_layout(max_servers, max_workers);
    if (magic != MAGIC) {
        snprintf(hex, sizeof hex, "0x%016llx", (unsigned long long)magic);
        PyErr_Format(LayoutMismatch, "bad magic %s (expected \"SDSGTLV1\"): not a shmdisagg control "
                     "segment", hex);
    } else if (init != INIT_READY) {
        PyErr_Format(LayoutMismatch, "init_state is %llu (expected 0 or %u)", (unsigned long long)init,
                     INIT_READY);
    } else if ((uint32_t)ver != LAYOUT_VERSION) {
        PyErr_Format(LayoutMismatch, "layout version %u, but this build reads version %u: run every "
                     "process of a deployment from the same install", (unsigned)(uint32_t)ver,
                     LAYOUT_VERSION);
    } else if ((uint32_t)(ver >> 32) != HEADER_BYTES) {
        PyErr_Format(LayoutMismatch, "header_bytes is %u (expected %u)", (unsigned)(ver >> 32),
                     HEADER_BYTES);
    } else if (max_servers < 64 || max_servers > MAX_SERVERS_LIMIT || max_servers % 64 != 0) {
        PyErr_Format(LayoutMismatch, "max_servers is %u (expected a multiple of 64 in 64..%u)",
                     max_servers, MAX_SERVERS_LIMIT);
    } else if (max_workers == 0 || max_workers > MAX_WORKERS_LIMIT) {
        PyErr_Format(LayoutMismatch, "max_workers is %u (expected 1..%u)", max_workers,
                     MAX_WORKERS_LIMIT);
    } else if (srv != ((uint64_t)l.off_servers | ((uint64_t)SERVER_STRIDE << 32)) ||
               wrk != ((uint64_t)l.off_workers | ((uint64_t)l.worker_stride << 32)) ||
               cfg != ((uint64_t)l.off_config | ((uint64_t)l.off_retired << 32))) {
        snprintf(hex, sizeof hex, "0x%llx/0x%llx/0x%llx", (unsigned long long)srv,
                 (unsigned long long)wrk, (unsigned long long)cfg);
        PyErr_Format(LayoutMismatch, "record offsets/strides %s do not match this build's layout "
                     "for %u servers", hex, max_servers);
    } else if (segbytes < l.bytes) {
        PyErr_Format(LayoutMismatch, "segment_bytes %llu is too small for %u servers and %u worker "
                     "rows (%zu)", (unsigned long long)segbytes, max_servers, max_workers, l.bytes);
    } else if (segbytes > self->len) {
        PyErr_Format(LayoutMismatch, "header says the segment is %llu bytes but only %zu are mapped",
                     (unsigned long long)segbytes, self->len);
    } else if (region_set_ready(self, max_servers, max_workers)) {
        result = Py_NewRef(Py_True);
    }
fail:
    return result;
}

/* ---- coordinator line ------------------------------------------------------------------- */

static PyObject *Region_set_coord(Region *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    uint64_t pid, start, inc;
    if (!nargs_ok("set_coord", nargs, 3) || !arg_u64(args[0], &pid) || !arg_u64(args[1], &start) ||
        !arg_u64(args[2], &inc) || !need_ready(self, 1))
        goto fail;
    ST(U64(self, C_PID), pid);
    ST(U64(self, C_START), start);
    ST(U64(self, C_INC), inc);
    result = Py_NewRef(Py_None);
fail:
    return result;
}

static PyObject *store_one(Region *self, PyObject *const *args, Py_ssize_t nargs, const char *fn,
                           size_t off)
{
    PyObject *result = NULL;
    uint64_t v;
    if (!nargs_ok(fn, nargs, 1) || !arg_u64(args[0], &v) || !need_ready(self, 1))
        goto fail;
    ST(U64(self, off), v);
    result = Py_NewRef(Py_None);
fail:
    return result;
}

static PyObject *Region_set_coord_heartbeat(Region *self, PyObject *const *args, Py_ssize_t nargs)
{
    return store_one(self, args, nargs, "set_coord_heartbeat", C_HEARTBEAT);
}

static PyObject *Region_set_coord_state(Region *self, PyObject *const *args, Py_ssize_t nargs)
{
    return store_one(self, args, nargs, "set_coord_state", C_STATE);
}

static PyObject *Region_coord(Region *self, PyObject *unused)
{
    PyObject *result = NULL;
    if (!need_ready(self, 0))
        goto fail;
    result = Py_BuildValue("(KKKKK)", (unsigned long long)LD(U64(self, C_PID)),
                           (unsigned long long)LD(U64(self, C_START)),
                           (unsigned long long)LD(U64(self, C_INC)),
                           (unsigned long long)LD(U64(self, C_HEARTBEAT)),
                           (unsigned long long)LD(U64(self, C_STATE)));
fail:
    return result;
}

/* ---- config block ----------------------------------------------------------------------- */

/* config_for_pick() and the seqlock read are in _native.h (inlined by the picks). */

static int config_read(Region *r, Config *out, uint64_t *last_seq)
{
    return r->nw == 1 ? config_read_nw(r, out, last_seq, 1) : config_read_nw(r, out, last_seq, r->nw);
}

int config_for_pick(Region *r, Config *out)
{
    return r->nw == 1 ? config_for_pick_nw(r, out, 1) : config_for_pick_nw(r, out, r->nw);
}

/* read_config() -> (present, healthy, role_ctx, role_gen, version): the masks as ints of
 * max_servers bits. */
static PyObject *Region_read_config(Region *self, PyObject *unused)
{
    PyObject *result = NULL, *m[CFG_SETS] = {NULL};
    Config c;
    uint64_t last = 0;
    if (!need_ready(self, 0))
        goto fail;
    if (!config_read(self, &c, &last)) {
        PyErr_Format(RetryExhausted, "config block sequence stayed odd (%llu) for %d tries",
                     (unsigned long long)last, SEQ_TRIES);
        goto fail;
    }
    if ((m[0] = set_to_long(&c.present, self->nw)) != NULL &&
        (m[1] = set_to_long(&c.healthy, self->nw)) != NULL &&
        (m[2] = set_to_long(&c.role[0], self->nw)) != NULL &&
        (m[3] = set_to_long(&c.role[1], self->nw)) != NULL)
        result = Py_BuildValue("(OOOOK)", m[0], m[1], m[2], m[3], (unsigned long long)c.version);
fail:
    for (unsigned i = 0; i < CFG_SETS; i++)
        Py_XDECREF(m[i]);
    return result;
}

static PyObject *Region_servers_version(Region *self, PyObject *unused)
{
    PyObject *result = NULL;
    if (need_ready(self, 0))
        result = PyLong_FromUnsignedLongLong(LDA(cfg_version(self)));
    return result;
}

/* Coordinator only: set slot's present/healthy/role bits from `flags`, bump servers_version.
 * Only the words holding slot's bit change; the others are rewritten as they were. */
static uint64_t config_apply(Region *r, int64_t slot, uint64_t flags)
{
    uint64_t *seq = cfg_seq(r), *ver_p = cfg_version(r), bit = 1ULL << (slot & 63), odd, ver;
    uint64_t *present = cfg_word(r, 0, (int)(slot >> 6)), *healthy = cfg_word(r, 1, (int)(slot >> 6));
    uint64_t *role0 = cfg_word(r, 2, (int)(slot >> 6)), *role1 = cfg_word(r, 3, (int)(slot >> 6));
    uint64_t role = (flags >> ROLE_SHIFT) & 0xFF;
    uint64_t p = LD(present) & ~bit, h = LD(healthy) & ~bit, r0 = LD(role0) & ~bit, r1 = LD(role1) & ~bit;
    if (flags & FLAG_PRESENT) {
        p |= bit;
        if (flags & FLAG_HEALTHY)
            h |= bit;
        if (role == 0)
            r0 |= bit;
        else if (role == 1)
            r1 |= bit;
    }
    ver = LD(ver_p) + 1;
    odd = seq_write_begin(seq);
    ST(present, p);
    ST(healthy, h);
    ST(role0, r0);
    ST(role1, r1);
    ST(ver_p, ver);
    seq_write_end(seq, odd);
    return ver;
}

/* ---- server records --------------------------------------------------------------------- */

static int flags_arg(PyObject *o, uint64_t *flags)
{
    int ok = arg_u64(o, flags);
    if (ok && (*flags > 0xFFFFFFFFULL || ((*flags >> ROLE_SHIFT) & 0xFF) >= MAX_ROLES)) {
        PyErr_Format(PyExc_ValueError, "bad server flags %llu (u32; role in bits 8..15 must be < %u)",
                     (unsigned long long)*flags, MAX_ROLES);
        ok = 0;
    }
    return ok;
}

/* write_server(slot, flags, max_batch_size, tokens_per_block, max_num_tokens, addr) -> incarnation
 * Rewrites the whole record (incarnation + 1, health time = now), then the config block. */
static PyObject *Region_write_server(Region *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    int64_t slot;
    uint64_t flags, mb, tpb, mnt, inc, odd, words[ADDR_BYTES / 8];
    char *rec;
    const char *addr;
    Py_ssize_t alen;
    if (!nargs_ok("write_server", nargs, 6) || !need_ready(self, 1) ||
        !arg_slot(self, args[0], &slot) || !flags_arg(args[1], &flags) ||
        !arg_u64(args[2], &mb) || !arg_u64(args[3], &tpb) || !arg_u64(args[4], &mnt) ||
        (rec = server_at(self, slot)) == NULL)
        goto fail;
    if (!PyBytes_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError, "addr must be bytes");
        goto fail;
    }
    addr = PyBytes_AS_STRING(args[5]);
    alen = PyBytes_GET_SIZE(args[5]);
    if (alen >= (Py_ssize_t)ADDR_BYTES || memchr(addr, 0, (size_t)alen) != NULL) {
        PyErr_Format(PyExc_ValueError, "addr must be at most %u bytes without NUL", ADDR_BYTES - 1);
        goto fail;
    }
    memset(words, 0, sizeof words);
    memcpy(words, addr, (size_t)alen);
    inc = LD((uint64_t *)(rec + S_INC)) + 1;
    odd = seq_write_begin((uint64_t *)(rec + S_SEQ));
    ST((uint64_t *)(rec + S_INC), inc);
    ST((uint64_t *)(rec + S_FLAGS), flags); /* weight (high half) is reserved: 0 */
    ST((uint64_t *)(rec + S_HEALTH), monotonic_ns());
    ST((uint64_t *)(rec + S_MAXBATCH), mb);
    ST((uint64_t *)(rec + S_TPB), tpb);
    ST((uint64_t *)(rec + S_MAXTOK), mnt);
    for (size_t i = 0; i < ADDR_BYTES / 8; i++)
        ST((uint64_t *)(rec + S_ADDR) + i, words[i]);
    seq_write_end((uint64_t *)(rec + S_SEQ), odd);
    config_apply(self, slot, flags);
    result = PyLong_FromUnsignedLongLong(inc);
fail:
    return result;
}

/* set_server_flags(slot, flags) -> servers_version: present/healthy/role change, record first. */
static PyObject *Region_set_server_flags(Region *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    int64_t slot;
    uint64_t flags, odd;
    char *rec;
    if (!nargs_ok("set_server_flags", nargs, 2) || !need_ready(self, 1) ||
        !arg_slot(self, args[0], &slot) || !flags_arg(args[1], &flags) ||
        (rec = server_at(self, slot)) == NULL)
        goto fail;
    odd = seq_write_begin((uint64_t *)(rec + S_SEQ));
    ST((uint64_t *)(rec + S_FLAGS), flags);
    ST((uint64_t *)(rec + S_HEALTH), monotonic_ns());
    seq_write_end((uint64_t *)(rec + S_SEQ), odd);
    result = PyLong_FromUnsignedLongLong(config_apply(self, slot, flags));
fail:
    return result;
}

/* read_server(slot) -> (incarnation, flags, weight, health_mono_ns, max_batch_size,
 *                       tokens_per_block, max_num_tokens, addr) ; RetryExhausted if torn. */
static PyObject *Region_read_server(Region *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    int64_t slot;
    uint64_t s0 = 0, v[6], words[ADDR_BYTES / 8 + 1];
    const uint64_t *seq;
    char *rec;
    int tries, ok = 0;
    if (!nargs_ok("read_server", nargs, 1) || !need_ready(self, 0) || !arg_i64(args[0], &slot) ||
        (rec = server_at(self, slot)) == NULL)
        goto fail;
    seq = (const uint64_t *)(rec + S_SEQ);
    for (tries = 0; tries < SEQ_TRIES && !ok; tries++) {
        s0 = LDA(seq);
        if ((s0 & 1) == 0) {
            for (int i = 0; i < 6; i++)
                v[i] = LD((uint64_t *)(rec + S_INC) + i);
            for (size_t i = 0; i < ADDR_BYTES / 8; i++)
                words[i] = LD((uint64_t *)(rec + S_ADDR) + i);
            ok = seq_read_ok(seq, s0);
        }
        if (!ok)
            cpu_relax();
    }
    self->seq_retries += (unsigned long long)(tries - 1);
    if (!ok) {
        PyErr_Format(RetryExhausted, "server record %lld: sequence stayed odd (%llu) for %d tries: "
                     "the coordinator died mid-write or is stalled", (long long)slot,
                     (unsigned long long)s0, SEQ_TRIES);
        goto fail;
    }
    words[ADDR_BYTES / 8] = 0; /* always NUL-terminated, whatever the segment holds */
    result = Py_BuildValue("(KKKKKKKy)", (unsigned long long)v[0],
                           (unsigned long long)(v[1] & 0xFFFFFFFFULL), (unsigned long long)(v[1] >> 32),
                           (unsigned long long)v[2], (unsigned long long)v[3], (unsigned long long)v[4],
                           (unsigned long long)v[5], (const char *)words);
fail:
    return result;
}

/* ---- worker rows ------------------------------------------------------------------------ */

static void row_zero(Region *r, char *p)
{
    for (size_t off = W_START; off < W_ACTIVE_REQ; off += 8)
        ST((uint64_t *)(p + off), 0);
    for (size_t i = 0; i < r->max_servers; i++) {
        ST((int32_t *)(p + W_ACTIVE_REQ) + i, 0);
        ST((int64_t *)(p + r->w_tok) + i, 0);
        ST((uint64_t *)(p + r->w_routed) + i, 0);
    }
}

/* claim_row(pid, starttime[, fleet_index]) -> (row, token): CAS 0 -> token on the first free
 * row. `fleet_index` (-1: none) is stored so that a restarted coordinator knows which fleet
 * index each live worker serves. */
static PyObject *Region_claim_row(Region *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    int64_t pid, fleet = -1;
    uint64_t start, token, expected, hwm, *hwm_p;
    char *p;
    if (nargs != 2 && nargs != 3) {
        PyErr_Format(PyExc_TypeError, "claim_row expected 2 or 3 arguments, got %zd", nargs);
        goto fail;
    }
    if (!arg_range(args[0], 1, 0xFFFFFFFFLL, "pid", &pid) || !arg_u64(args[1], &start) ||
        (nargs == 3 && !arg_range(args[2], -1, 0xFFFFFFFFLL, "fleet_index", &fleet)) || !need_ready(self, 1))
        goto fail;
    token = ((uint64_t)pid << 32) | (ADD(U64(self, RL_CLAIM_SEQ), 1) & 0xFFFFFFFFULL);
    for (uint32_t w = 0; w < self->max_workers; w++) {
        if ((p = row_at(self, w)) == NULL)
            goto fail;
        expected = TOKEN_FREE;
        if (LD((uint64_t *)(p + W_TOKEN)) != TOKEN_FREE ||
            !__atomic_compare_exchange_n((uint64_t *)(p + W_TOKEN), &expected, token, 0,
                                         __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            continue;
        row_zero(self, p);
        ST((uint64_t *)(p + W_PID), (uint64_t)pid);
        ST((uint64_t *)(p + W_FLEET), (uint64_t)(fleet + 1));
        ST((uint64_t *)(p + W_START), start);
        ST((uint64_t *)(p + W_HEARTBEAT), monotonic_ns());
        hwm_p = U64(self, RL_HWM);
        hwm = LD(hwm_p);
        while (hwm < (uint64_t)w + 1 &&
               !__atomic_compare_exchange_n(hwm_p, &hwm, (uint64_t)w + 1, 1, __ATOMIC_RELEASE,
                                            __ATOMIC_RELAXED))
            ;
        self->tokens[w] = token;
        result = Py_BuildValue("(IK)", w, (unsigned long long)token);
        goto fail;
    }
    PyErr_Format(SegmentFull, "no free worker row: all %u rows are claimed (raise max_workers)",
                 self->max_workers);
fail:
    return result;
}

/* heartbeat(row) -> bool: store now (CLOCK_MONOTONIC ns); False if the row is no longer ours. */
static PyObject *Region_heartbeat(Region *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    int64_t row;
    char *p;
    if (!nargs_ok("heartbeat", nargs, 1) || !arg_i64(args[0], &row))
        goto fail;
    p = own_row(self, row, 1);
    if (p == NULL && PyErr_Occurred())
        goto fail;
    if (p != NULL)
        ST((uint64_t *)(p + W_HEARTBEAT), monotonic_ns());
    result = Py_NewRef(p != NULL ? Py_True : Py_False);
fail:
    return result;
}

/* reclaim_row(row) -> bool (coordinator): OWNED -> RECLAIMING, retire totals, zero, release 0. */
static PyObject *Region_reclaim_row(Region *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    int64_t row;
    uint64_t token, *tok_p, *retired;
    char *p;
    if (!nargs_ok("reclaim_row", nargs, 1) || !arg_i64(args[0], &row) || !need_ready(self, 1) ||
        (p = row_at(self, row)) == NULL)
        goto fail;
    tok_p = (uint64_t *)(p + W_TOKEN);
    token = LDA(tok_p);
    if (token == TOKEN_FREE || token == TOKEN_RECLAIMING ||
        !__atomic_compare_exchange_n(tok_p, &token, TOKEN_RECLAIMING, 0, __ATOMIC_ACQ_REL,
                                     __ATOMIC_RELAXED)) {
        result = Py_NewRef(Py_False);
        goto fail;
    }
    retired = (uint64_t *)(self->base + self->off_retired);
    for (size_t s = 0; s < self->max_servers; s++)
        ADD(&retired[s], LD((uint64_t *)(p + self->w_routed) + s));
    ADD(U64(self, RET_COMPLETED), LD((uint64_t *)(p + W_COMPLETED)));
    ADD(U64(self, RET_DISPATCHED), LD((uint64_t *)(p + W_DISPATCHED)));
    row_zero(self, p);
    if (self->tokens[row] == token)
        self->tokens[row] = 0;
    STR(tok_p, TOKEN_FREE);
    result = Py_NewRef(Py_True);
fail:
    return result;
}

/* rows() -> [(row, token, pid, starttime, heartbeat_ns, dispatched, completed)] of owned rows. */
static PyObject *Region_rows(Region *self, PyObject *unused)
{
    PyObject *result = NULL, *item;
    uint32_t n;
    uint64_t token;
    char *p;
    if (!need_ready(self, 0) || (result = PyList_New(0)) == NULL)
        goto fail;
    n = rows_in_use(self);
    for (uint32_t w = 0; w < n; w++) {
        if ((p = row_at(self, w)) == NULL) {
            Py_CLEAR(result);
            goto fail;
        }
        token = LDA((uint64_t *)(p + W_TOKEN));
        if (token == TOKEN_FREE || token == TOKEN_RECLAIMING)
            continue;
        item = Py_BuildValue("(IKKKKKKL)", w, (unsigned long long)token,
                             (unsigned long long)LD((uint64_t *)(p + W_PID)),
                             (unsigned long long)LD((uint64_t *)(p + W_START)),
                             (unsigned long long)LD((uint64_t *)(p + W_HEARTBEAT)),
                             (unsigned long long)LD((uint64_t *)(p + W_DISPATCHED)),
                             (unsigned long long)LD((uint64_t *)(p + W_COMPLETED)),
                             (long long)LD((uint64_t *)(p + W_FLEET)) - 1);
        if (item == NULL || PyList_Append(result, item) < 0) {
            Py_XDECREF(item);
            Py_CLEAR(result);
            goto fail;
        }
        Py_DECREF(item);
    }
fail:
    return result;
}

/* ---- picks ------------------------------------------------------------------------------ */

void row_add_pick(Region *r, char *p, int slot, int64_t tokens)
{
    ADD((int32_t *)(p + W_ACTIVE_REQ) + slot, 1);
    ADD((int64_t *)(p + r->w_tok) + slot, tokens);
    ADD((uint64_t *)(p + r->w_routed) + slot, 1);
    ADD((uint64_t *)(p + W_DISPATCHED), 1);
}

/* Shared entry of both picks: own row, role, candidate set (present & healthy & role - exclude). */
static char *pick_setup(Region *self, PyObject *const *args, int64_t *role, Set *cand, int64_t *tokens)
{
    char *p = NULL;
    int64_t row, exclude;
    Config c;
    if (!arg_i64(args[0], &row) || !arg_range(args[1], 0, MAX_ROLES - 1, "role", role) ||
        !arg_i64(args[2], &exclude) || !arg_range(args[3], 0, INT64_MAX, "tokens", tokens) ||
        (p = own_row(self, row, 0)) == NULL)
        goto fail;
    if (self->nw == 1 ? !config_for_pick_nw(self, &c, 1) : !config_for_pick_nw(self, &c, self->nw)) {
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

/* The round robin's choice among cand: the (ticket mod n)-th candidate; -1 if none. */
INLINE int rr_choice(Region *r, int role, const Set *cand, int nw)
{
    uint64_t n = set_count(cand, nw), ticket;
    if (n == 0)
        return -1;
    ticket = ADD(U64(r, OFF_RR + (size_t)role * RR_STRIDE), 1);
    return set_nth(cand, nw, ticket % n);
}

/* pick_round_robin(row, role, exclude_slot, tokens) -> slot or -1 */
static PyObject *Region_pick_round_robin(Region *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    int64_t role, tokens;
    Set cand;
    int slot;
    char *p;
    if (!nargs_ok("pick_round_robin", nargs, 4) ||
        (p = pick_setup(self, args, &role, &cand, &tokens)) == NULL)
        goto fail;
    slot = self->nw == 1 ? rr_choice(self, (int)role, &cand, 1) : rr_choice(self, (int)role, &cand, self->nw);
    if (slot >= 0)
        row_add_pick(self, p, slot, tokens);
    result = PyLong_FromLong(slot);
fail:
    return result;
}

int sum_loads(Region *r, const int *slots, int n, int use_tokens, int64_t *sums)
{
    uint32_t nrows = rows_in_use(r);
    size_t w_tok = r->w_tok;
    char *q;
    for (int k = 0; k < n; k++)
        sums[k] = 0;
    for (uint32_t w = 0; w < nrows; w++) {
        if ((q = row_at(r, w)) == NULL)
            return -1;
        if (LDA((uint64_t *)(q + W_TOKEN)) == TOKEN_FREE)
            continue;
        if (use_tokens) {
            const int64_t *tok = (const int64_t *)(q + w_tok); /* (hoisted: the atomic loads keep the compiler from it) */
            for (int k = 0; k < n; k++)
                sums[k] += LD(tok + slots[k]);
        } else {
            const int32_t *req = (const int32_t *)(q + W_ACTIVE_REQ);
            for (int k = 0; k < n; k++)
                sums[k] += LD(req + slots[k]);
        }
    }
    return 0;
}

int pick_tied(Region *r, int role, const int *tied, int n)
{
    uint64_t ticket;
    int slot = tied[0];
    if (n > 1) { /* a tie: rotate with the role's ticket, no herding */
        ticket = ADD(U64(r, OFF_RR + (size_t)role * RR_STRIDE), 1);
        slot = tied[ticket % (uint64_t)n];
    }
    return slot;
}

/* pick_least_loaded(row, role, exclude_slot, tokens, use_tokens) -> slot or -1 */
static PyObject *Region_pick_least_loaded(Region *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    int64_t role, tokens, sums[MAX_SERVERS_LIMIT], best = INT64_MAX;
    Set cand;
    int use_tokens, slots[MAX_SERVERS_LIMIT], tied[MAX_SERVERS_LIMIT], n, nt = 0, slot = -1;
    char *p;
    if (!nargs_ok("pick_least_loaded", nargs, 5) ||
        (p = pick_setup(self, args, &role, &cand, &tokens)) == NULL ||
        (use_tokens = PyObject_IsTrue(args[4])) < 0)
        goto fail;
    n = self->nw == 1 ? set_slots(&cand, 1, slots) : set_slots(&cand, self->nw, slots);
    if (n > 0) {
        if (sum_loads(self, slots, n, use_tokens, sums) < 0)
            goto fail;
        for (int k = 0; k < n; k++) {
            if (sums[k] < best) {
                best = sums[k];
                nt = 0;
            }
            if (sums[k] == best)
                tied[nt++] = slots[k];
        }
        slot = pick_tied(self, (int)role, tied, nt);
        row_add_pick(self, p, slot, tokens);
    }
    result = PyLong_FromLong(slot);
fail:
    return result;
}

/* complete(row, slot, tokens) -> bool: undo one pick in the own row; False (nothing done) when the
 * row was reclaimed meanwhile, because its counters were already zeroed. */
static PyObject *Region_complete(Region *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    int64_t row, slot, tokens;
    char *p;
    if (!nargs_ok("complete", nargs, 3) || !arg_i64(args[0], &row) || !need_ready(self, 1) ||
        !arg_slot(self, args[1], &slot) || !arg_range(args[2], 0, INT64_MAX, "tokens", &tokens))
        goto fail;
    p = own_row(self, row, 1);
    if (p == NULL && PyErr_Occurred())
        goto fail;
    if (p != NULL) {
        ADD((int32_t *)(p + W_ACTIVE_REQ) + slot, -1);
        ADD((int64_t *)(p + self->w_tok) + slot, -tokens);
        ADD((uint64_t *)(p + W_COMPLETED), 1);
    }
    result = Py_NewRef(p != NULL ? Py_True : Py_False);
fail:
    return result;
}

/* ---- index publication and metrics ---------------------------------------------------- */

/* publish_index(generation, capacity, segment_bytes, name) (coordinator): seqlock-write which
 * index segment workers must map. The index segment is fully built and PUBLISHED before this. */
static PyObject *Region_publish_index(Region *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    uint64_t gen, cap, bytes, odd, words[IP_NAME_BYTES / 8], *seq;
    const char *name;
    Py_ssize_t nlen;
    if (!nargs_ok("publish_index", nargs, 4) || !need_ready(self, 1) || !arg_u64(args[0], &gen) ||
        !arg_u64(args[1], &cap) || !arg_u64(args[2], &bytes))
        goto fail;
    if (!PyBytes_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "name must be bytes");
        goto fail;
    }
    name = PyBytes_AS_STRING(args[3]);
    nlen = PyBytes_GET_SIZE(args[3]);
    if (gen == 0 || nlen == 0 || nlen >= (Py_ssize_t)IP_NAME_BYTES ||
        memchr(name, 0, (size_t)nlen) != NULL) {
        PyErr_Format(PyExc_ValueError, "generation must be > 0 and name 1..%u bytes without NUL",
                     IP_NAME_BYTES - 1);
        goto fail;
    }
    memset(words, 0, sizeof words);
    memcpy(words, name, (size_t)nlen);
    if (LD(U64(self, IP_GEN)) != 0)
        ST(U64(self, IM_WORD(IM_RESIZES)), LD(U64(self, IM_WORD(IM_RESIZES))) + 1);
    seq = U64(self, IP_SEQ);
    odd = seq_write_begin(seq);
    ST(U64(self, IP_CAP), cap);
    ST(U64(self, IP_BYTES), bytes);
    for (size_t i = 0; i < IP_NAME_BYTES / 8; i++)
        ST(U64(self, IP_NAME + 8 * i), words[i]);
    STR(U64(self, IP_GEN), gen); /* a pick's single acquire load of IP_GEN sees the new name too */
    seq_write_end(seq, odd);
    result = Py_NewRef(Py_None);
fail:
    return result;
}

/* index_publication() -> (generation, capacity, segment_bytes, name); generation 0: none yet. */
static PyObject *Region_index_publication(Region *self, PyObject *unused)
{
    PyObject *result = NULL;
    const uint64_t *seq;
    uint64_t s0 = 0, gen = 0, cap = 0, bytes = 0, words[IP_NAME_BYTES / 8 + 1];
    int tries, ok = 0;
    if (!need_ready(self, 0))
        goto fail;
    seq = U64(self, IP_SEQ);
    for (tries = 0; tries < SEQ_TRIES && !ok; tries++) {
        s0 = LDA(seq);
        if ((s0 & 1) == 0) {
            gen = LD(U64(self, IP_GEN));
            cap = LD(U64(self, IP_CAP));
            bytes = LD(U64(self, IP_BYTES));
            for (size_t i = 0; i < IP_NAME_BYTES / 8; i++)
                words[i] = LD(U64(self, IP_NAME + 8 * i));
            ok = seq_read_ok(seq, s0);
        }
        if (!ok)
            cpu_relax();
    }
    self->seq_retries += (unsigned long long)(tries - 1);
    if (!ok) {
        PyErr_Format(RetryExhausted, "index publication: sequence stayed odd (%llu) for %d tries",
                     (unsigned long long)s0, SEQ_TRIES);
        goto fail;
    }
    words[IP_NAME_BYTES / 8] = 0;
    result = Py_BuildValue("(KKKy)", (unsigned long long)gen, (unsigned long long)cap,
                           (unsigned long long)bytes, (const char *)words);
fail:
    return result;
}

/* index_generation() -> the published generation (one acquire load, as every pick does). */
static PyObject *Region_index_generation(Region *self, PyObject *unused)
{
    PyObject *result = NULL;
    if (need_ready(self, 0))
        result = PyLong_FromUnsignedLongLong(LDA(U64(self, IP_GEN)));
    return result;
}

/* count_index_dropped(n) (coordinator): events the ingest dropped (unknown server, malformed). */
static PyObject *Region_count_index_dropped(Region *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    uint64_t n, *w;
    if (!nargs_ok("count_index_dropped", nargs, 1) || !arg_u64(args[0], &n) || !need_ready(self, 1))
        goto fail;
    w = U64(self, IM_WORD(IM_DROPPED));
    ST(w, LD(w) + n);
    result = Py_NewRef(Py_None);
fail:
    return result;
}

static const char *const IM_NAMES[IM_WORDS] = {
    "events_applied", "blocks_applied", "blocks_stored", "blocks_removed", "servers_cleared",
    "events_dropped", "live", "dead", "used", "max_probe", "sessions", "implicit_entries",
    "sweeps", "routed_expired", "evicted", "resizes", "last_sweep_ns", "lag_samples",
    "lag_sum_ns",
};

/* index_metrics() -> dict of the index metrics (relaxed loads), "lag_hist" a list of LAG_BUCKETS
 * counts (log-linear ns buckets, see OFF_LAGHIST). */
static PyObject *Region_index_metrics(Region *self, PyObject *unused)
{
    PyObject *result = NULL, *v = NULL, *hist = NULL;
    if (!need_ready(self, 0) || (result = PyDict_New()) == NULL)
        goto fail;
    for (int i = 0; i < IM_WORDS; i++) {
        if ((v = PyLong_FromUnsignedLongLong(LD(U64(self, IM_WORD(i))))) == NULL ||
            PyDict_SetItemString(result, IM_NAMES[i], v) < 0)
            goto error;
        Py_CLEAR(v);
    }
    if ((v = PyLong_FromUnsignedLongLong(LD(U64(self, IC_FULL_DROPS)))) == NULL ||
        PyDict_SetItemString(result, "index_full_drops", v) < 0)
        goto error;
    Py_CLEAR(v);
    if ((v = PyLong_FromUnsignedLongLong(LD(U64(self, IC_RACE_RERUNS)))) == NULL ||
        PyDict_SetItemString(result, "race_reruns", v) < 0)
        goto error;
    Py_CLEAR(v);
    if ((v = PyLong_FromUnsignedLongLong(LD(U64(self, IP_GEN)))) == NULL ||
        PyDict_SetItemString(result, "generation", v) < 0)
        goto error;
    Py_CLEAR(v);
    if ((hist = PyList_New(LAG_BUCKETS)) == NULL)
        goto error;
    for (unsigned b = 0; b < LAG_BUCKETS; b++) {
        if ((v = PyLong_FromUnsignedLongLong(LD(U64(self, OFF_LAGHIST + 8 * b)))) == NULL)
            goto error;
        PyList_SET_ITEM(hist, b, v);
        v = NULL;
    }
    if (PyDict_SetItemString(result, "lag_hist", hist) < 0)
        goto error;
    goto fail;
error:
    Py_CLEAR(result);
fail:
    Py_XDECREF(v);
    Py_XDECREF(hist);
    return result;
}

/* ---- stats ------------------------------------------------------------------------------ */

/* load(slot) -> (active_requests, active_tokens) summed over claimed rows. */
static PyObject *Region_load(Region *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    int64_t slot, req = 0, tok = 0;
    uint32_t n;
    char *q;
    if (!nargs_ok("load", nargs, 1) || !need_ready(self, 0) ||
        !arg_slot(self, args[0], &slot))
        goto fail;
    n = rows_in_use(self);
    for (uint32_t w = 0; w < n; w++) {
        if ((q = row_at(self, w)) == NULL)
            goto fail;
        if (LDA((uint64_t *)(q + W_TOKEN)) == TOKEN_FREE)
            continue;
        req += LD((int32_t *)(q + W_ACTIVE_REQ) + slot);
        tok += LD((int64_t *)(q + self->w_tok) + slot);
    }
    result = Py_BuildValue("(LL)", (long long)req, (long long)tok);
fail:
    return result;
}

/* routed(slot) -> picks of slot over all rows plus the retired totals of reclaimed rows. */
static PyObject *Region_routed(Region *self, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    int64_t slot;
    uint64_t total;
    uint32_t n;
    char *q;
    if (!nargs_ok("routed", nargs, 1) || !need_ready(self, 0) ||
        !arg_slot(self, args[0], &slot))
        goto fail;
    total = LD((uint64_t *)(self->base + self->off_retired) + slot);
    n = rows_in_use(self);
    for (uint32_t w = 0; w < n; w++) {
        if ((q = row_at(self, w)) == NULL)
            goto fail;
        total += LD((uint64_t *)(q + self->w_routed) + slot);
    }
    result = PyLong_FromUnsignedLongLong(total);
fail:
    return result;
}

/* retired() -> (dispatched, completed) totals of reclaimed rows. */
static PyObject *Region_retired(Region *self, PyObject *unused)
{
    PyObject *result = NULL;
    if (need_ready(self, 0))
        result = Py_BuildValue("(KK)", (unsigned long long)LD(U64(self, RET_DISPATCHED)),
                               (unsigned long long)LD(U64(self, RET_COMPLETED)));
    return result;
}

static PyObject *Region_get_size(Region *self, void *closure)
{
    return PyLong_FromSize_t(self->has_view ? self->len : 0);
}

static PyObject *Region_get_max_workers(Region *self, void *closure)
{
    return PyLong_FromUnsignedLong(self->ready ? self->max_workers : 0);
}

static PyObject *Region_get_max_servers(Region *self, void *closure)
{
    return PyLong_FromUnsignedLong(self->ready ? self->max_servers : 0);
}

static PyObject *Region_get_stats(Region *self, void *closure)
{
    return Py_BuildValue("{sKsK}", "seq_retries", self->seq_retries, "config_fallbacks",
                         self->cfg_fallbacks);
}

/* ---- module ----------------------------------------------------------------------------- */

static PyObject *mod_control_size(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    int64_t mw, ms = DEFAULT_MAX_SERVERS;
    if (nargs != 1 && nargs != 2)
        PyErr_Format(PyExc_TypeError, "control_size expected 1 or 2 arguments, got %zd", nargs);
    else if (arg_range(args[0], 1, MAX_WORKERS_LIMIT, "max_workers", &mw) &&
             (nargs == 1 || arg_servers(args[1], &ms)))
        result = PyLong_FromSize_t(control_size_for((uint32_t)ms, (uint32_t)mw));
    return result;
}

static PyObject *mod_control_layout(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *result = NULL;
    int64_t mw, ms;
    ControlLayout l;
    if (nargs_ok("control_layout", nargs, 2) && arg_servers(args[0], &ms) &&
        arg_range(args[1], 1, MAX_WORKERS_LIMIT, "max_workers", &mw)) {
        l = control_layout((uint32_t)ms, (uint32_t)mw);
        result = Py_BuildValue("(nnnnnn)", (Py_ssize_t)l.off_config, (Py_ssize_t)l.off_retired,
                               (Py_ssize_t)l.off_servers, (Py_ssize_t)l.off_workers,
                               (Py_ssize_t)l.worker_stride, (Py_ssize_t)l.bytes);
    }
    return result;
}

#define FAST(name, doc) {#name, (PyCFunction)(void (*)(void))Region_##name, METH_FASTCALL, doc}
#define NOARG(name, doc) {#name, (PyCFunction)(void (*)(void))Region_##name, METH_NOARGS, doc}

static PyMethodDef Region_methods[] = {
    NOARG(release, "Drop the buffer export; the Region is unusable afterwards."),
    FAST(init_control, "init_control(max_workers, created_wall_ns[, max_servers]) -> segment_bytes"),
    NOARG(check_control, "check_control() -> bool (False: not READY yet); LayoutMismatch"),
    FAST(set_coord, "set_coord(pid, starttime, incarnation)"),
    FAST(set_coord_heartbeat, "set_coord_heartbeat(mono_ns)"),
    FAST(set_coord_state, "set_coord_state(state)"),
    NOARG(coord, "coord() -> (pid, starttime, incarnation, heartbeat_ns, state)"),
    NOARG(read_config, "read_config() -> (present, healthy, role_ctx, role_gen, version)"),
    NOARG(servers_version, "servers_version() -> int"),
    FAST(write_server, "write_server(slot, flags, max_batch, tpb, max_num_tokens, addr) -> inc"),
    FAST(set_server_flags, "set_server_flags(slot, flags) -> servers_version"),
    FAST(read_server, "read_server(slot) -> (inc, flags, weight, health_ns, mb, tpb, mnt, addr)"),
    FAST(claim_row, "claim_row(pid, starttime[, fleet_index]) -> (row, token)"),
    FAST(heartbeat, "heartbeat(row) -> bool"),
    FAST(reclaim_row, "reclaim_row(row) -> bool"),
    NOARG(rows, "rows() -> [(row, token, pid, starttime, heartbeat_ns, dispatched, completed, fleet_index)]"),
    FAST(pick_round_robin, "pick_round_robin(row, role, exclude_slot, tokens) -> slot | -1"),
    FAST(pick_least_loaded, "pick_least_loaded(row, role, exclude, tokens, use_tokens) -> slot"),
    FAST(complete, "complete(row, slot, tokens) -> bool"),
    FAST(load, "load(slot) -> (active_requests, active_tokens)"),
    FAST(routed, "routed(slot) -> int"),
    NOARG(retired, "retired() -> (dispatched, completed)"),
    FAST(publish_index, "publish_index(generation, capacity, segment_bytes, name)"),
    NOARG(index_publication, "index_publication() -> (generation, capacity, segment_bytes, name)"),
    NOARG(index_generation, "index_generation() -> int (0: no index published yet)"),
    FAST(count_index_dropped, "count_index_dropped(n): events dropped by the ingest"),
    NOARG(index_metrics, "index_metrics() -> dict of the index metrics and lag histogram"),
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Region_getset[] = {
    {"size", (getter)Region_get_size, NULL, "mapped length in bytes (0 once released)", NULL},
    {"max_workers", (getter)Region_get_max_workers, NULL, "worker rows (0 until validated)", NULL},
    {"max_servers", (getter)Region_get_max_servers, NULL, "server slots (0 until validated)", NULL},
    {"stats", (getter)Region_get_stats, NULL, "process-local seqlock retry counters", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject RegionType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmdisagg._native.Region",
    .tp_basicsize = sizeof(Region),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Region(buffer, writable=True): atomic access to one mapped control segment.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Region_init,
    .tp_dealloc = (destructor)Region_dealloc,
    .tp_methods = Region_methods,
    .tp_getset = Region_getset,
};

static PyMethodDef module_methods[] = {
    {"control_size", (PyCFunction)(void (*)(void))mod_control_size, METH_FASTCALL,
     "control_size(max_workers[, max_servers]) -> logical control-segment size in bytes"},
    {"control_layout", (PyCFunction)(void (*)(void))mod_control_layout, METH_FASTCALL,
     "control_layout(max_servers, max_workers) -> (off_config, off_retired, off_servers, "
     "off_workers, worker_stride, segment_bytes)"},
    {"token_ids_ok", (PyCFunction)(void (*)(void))mod_token_ids_ok, METH_FASTCALL,
     "token_ids_ok(obj) -> True if obj is a non-empty list of ints in [0, 2**31)"},
    {"token_ids_int32", (PyCFunction)(void (*)(void))mod_token_ids_int32, METH_FASTCALL,
     "token_ids_int32(obj) -> bytes of native int32 if obj is a non-empty list of ints in "
     "[0, 2**31), else None"},
    {"block_hashes_v1", (PyCFunction)(void (*)(void))mod_block_hashes_v1,
     METH_FASTCALL | METH_KEYWORDS,
     "block_hashes_v1(tokens, tokens_per_block, salt_id=None) -> bytes of u64 LE per block"},
    {"block_hashes_v2", (PyCFunction)(void (*)(void))mod_block_hashes_v2,
     METH_FASTCALL | METH_KEYWORDS,
     "block_hashes_v2(tokens, tokens_per_block, salt_id=None, lora_id=None, token_bytes=4) -> "
     "bytes of 32-byte SHA-256 keys per block"},
    {"block_hashes_v2_64", (PyCFunction)(void (*)(void))mod_block_hashes_v2_64,
     METH_FASTCALL | METH_KEYWORDS,
     "block_hashes_v2_64(tokens, tokens_per_block, salt_id=None, lora_id=None, token_bytes=4) -> "
     "bytes of u64 LE per block (first 8 key bytes read big-endian)"},
    {"_v1_impl", (PyCFunction)(void (*)(void))mod_v1_impl, METH_FASTCALL,
     "_v1_impl(force_portable=None) -> 'avx2' | 'portable': the v1 and prefix-cache code in use (tests)"},
    {"_sha256_impl", (PyCFunction)(void (*)(void))mod_sha256_impl, METH_FASTCALL,
     "_sha256_impl(force=None) -> 'shani' | 'portable' (tests: force the portable code)"},
    {"seed_huge", (PyCFunction)(void (*)(void))mod_seed_huge, METH_FASTCALL,
     "seed_huge(fd, length): size a new shared-memory file and allocate one 4 KiB page per 2 MiB range, so that SharedMapping.collapse() can put it on huge pages"},
    {"json_long_digits", (PyCFunction)(void (*)(void))mod_json_long_digits, METH_FASTCALL,
     "json_long_digits(data) -> True if data holds a run of 19 or more ASCII digits (a JSON integer "
     "orjson would decode as a float may be there)"},
    {"json_token_ids", (PyCFunction)(void (*)(void))mod_json_token_ids, METH_FASTCALL,
     "json_token_ids(data, key) -> (start, end, int32 bytes) of the last top-level member key when it is a "
     "non-empty JSON array of ints in [0, 2**31), or None"},
    {"json_member", (PyCFunction)(void (*)(void))mod_json_member, METH_FASTCALL,
     "json_member(data, key) -> (start, end) of the last top-level member key's value in a JSON object, or None"},
    {"sse_scan", (PyCFunction)(void (*)(void))mod_sse_scan, METH_FASTCALL,
     "sse_scan(data) -> end << 8 | flags (1 internal or error key, 2 finish_reason string, 4 usage, 8 [DONE]) of data[:end], the complete SSE events"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_native",
    "Atomic access to shmdisagg's shared-memory segments; KV block hashing.",
    -1, module_methods, NULL, NULL, NULL, NULL,
};

static int add_exc(PyObject *m, PyObject **slot, const char *name, PyObject *base, const char *doc)
{
    *slot = PyErr_NewExceptionWithDoc(name, doc, base, NULL);
    return *slot != NULL && PyModule_AddObjectRef(m, strrchr(name, '.') + 1, *slot) == 0;
}

PyMODINIT_FUNC PyInit__native(void)
{
    PyObject *m = NULL, *magic = NULL;
    if (PyType_Ready(&RegionType) < 0 || PyType_Ready(&IndexType) < 0 ||
        PyType_Ready(&PrefixHashCacheType) < 0 || PyType_Ready(&SharedMappingType) < 0 || (m = PyModule_Create(&moduledef)) == NULL)
        goto fail;
    if (PyModule_AddObjectRef(m, "Region", (PyObject *)&RegionType) < 0 ||
        PyModule_AddObjectRef(m, "Index", (PyObject *)&IndexType) < 0 ||
        PyModule_AddObjectRef(m, "PrefixHashCache", (PyObject *)&PrefixHashCacheType) < 0 ||
        PyModule_AddObjectRef(m, "SharedMapping", (PyObject *)&SharedMappingType) < 0 ||
        !add_exc(m, &ShmError, "shmdisagg._native.ShmError", NULL, "Shared-memory failure.") ||
        !add_exc(m, &LayoutMismatch, "shmdisagg._native.LayoutMismatch", ShmError,
                 "The segment header does not describe this build's layout.") ||
        !add_exc(m, &RetryExhausted, "shmdisagg._native.RetryExhausted", ShmError,
                 "A seqlocked record stayed odd for SEQ_TRIES tries (writer dead or stalled).") ||
        !add_exc(m, &SegmentFull, "shmdisagg._native.SegmentFull", ShmError,
                 "No room: /dev/shm is full or every worker row is claimed.") ||
        !add_exc(m, &RowLost, "shmdisagg._native.RowLost", ShmError,
                 "The caller's worker row is no longer owned by it (reclaimed)."))
        goto error;
#define CONST(name) (PyModule_AddIntConstant(m, #name, (long)(name)) < 0)
    if (CONST(LAYOUT_VERSION) || CONST(HEADER_BYTES) || CONST(MAX_SERVERS_LIMIT) ||
        CONST(DEFAULT_MAX_SERVERS) || CONST(MAX_ROLES) || CONST(SERVER_STRIDE) ||
        CONST(MAX_WORKERS_LIMIT) || CONST(OFF_COORD) || CONST(OFF_CONFIG) || CONST(OFF_RR) ||
        CONST(OFF_ROWS_LINE) || CONST(SEQ_TRIES) ||
        CONST(FLAG_PRESENT) || CONST(FLAG_HEALTHY) || CONST(ROLE_SHIFT) || CONST(ADDR_BYTES) ||
        CONST(H_INIT) || CONST(H_VERSION) || CONST(S_SEQ) || CONST(CFG_SEQ) ||
        CONST(OFF_IDXPUB) || CONST(IP_GEN) || CONST(IP_SEQ) || CONST(IP_NAME_BYTES) ||
        CONST(OFF_IDXMET) || CONST(OFF_LAGHIST) || CONST(LAG_BUCKETS) || !index_add_constants(m) ||
        CONST(SSE_INTERNAL) || CONST(SSE_FINISHED) || CONST(SSE_USAGE) || CONST(SSE_DONE) ||
        (magic = PyLong_FromUnsignedLongLong(MAGIC)) == NULL ||
        PyModule_AddObjectRef(m, "MAGIC", magic) < 0)
        goto error;
#undef CONST
    Py_DECREF(magic);
    goto fail;
error:
    Py_XDECREF(magic);
    Py_CLEAR(m);
fail:
    return m;
}
