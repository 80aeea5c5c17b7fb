/*
 * sse_scan(chunk) -> int: one pass over a relayed SSE chunk (JSON events), for the fleet
 * worker's StreamGuard (shmdisagg/orchestrator/answers.py), which must look at every streamed chunk of every
 * request. Python's `re` took 2-2.5 us for the same question on a 200-byte chunk (an
 * alternation tried at every quote); this walks the quotes with memchr and compares the few
 * keys that matter, about 0.1 us (BENCHMARKS.md, "Relaying a streamed chunk").
 *
 * A JSON key is a '"' followed by the key's bytes, a '"', optional whitespace and ':'. String
 * contents are escaped, so a '"' inside one is preceded by '\' and never followed by a key and
 * an unescaped '"': what matches here is a key. Bits of the result, over the complete events:
 *   SSE_INTERNAL (1)  an internal key whose value is not null, or an "error" key
 *   SSE_FINISHED (2)  "finish_reason" with a string value
 *   SSE_USAGE    (4)  "completion_tokens" (a usage object)
 *   SSE_DONE     (8)  the complete events end with `data: [DONE]`
 * and, above bit 8, where the complete events end (the rest is an event still arriving).
 * The key list is answers.INTERNAL_KEYS; tests/unit/core/test_answers.py checks both agree.
 */
#include "_native.h"

#include <stdint.h>

typedef struct {
    const char *name;
    Py_ssize_t len;
    int kind; /* 0 internal (non-null value), 1 error, 2 finish_reason, 3 completion_tokens */
} SseKey;

#define K(s, kind) {s, sizeof(s) - 1, kind}
static const SseKey SSE_KEYS[] = {
    K("disaggregated_params", 0), K("prompt_token_ids", 0), K("prompt_token_ids_b64", 0),
    K("kv_transfer_params", 0), K("ctx_request_id", 0), K("disagg_request_id", 0),
    K("encoded_opaque_state", 0), K("ctx_info_endpoint", 0), K("first_gen_tokens", 0),
    K("ctx_usage", 0), K("error", 1), K("finish_reason", 2), K("completion_tokens", 3),
};
#undef K
#define SSE_NKEYS ((int)(sizeof SSE_KEYS / sizeof SSE_KEYS[0]))

static inline const char *skip_ws(const char *p, const char *end)
{
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r'))
        p++;
    return p;
}

/* The key starting at k (just past a '"'), matched against SSE_KEYS: its flag bits, and *next set
 * past its ':' when it is one (else left alone). */
static int match_key(const char *k, const char *end, const char **next)
{
    char c = *k;
    for (int i = 0; i < SSE_NKEYS; i++) {
        const SseKey *key = &SSE_KEYS[i];
        if (key->name[0] != c || end - k < key->len + 1 || k[key->len] != '"' ||
            memcmp(k, key->name, (size_t)key->len) != 0)
            continue;
        const char *v = skip_ws(k + key->len + 1, end);
        if (v >= end || *v != ':')
            return 0; /* a string value spelled like a key */
        v = skip_ws(v + 1, end);
        *next = v;
        switch (key->kind) {
        case 0:
            return end - v >= 4 && memcmp(v, "null", 4) == 0 ? 0 : SSE_INTERNAL;
        case 1:
            return SSE_INTERNAL;
        case 2:
            return v < end && *v == '"' ? SSE_FINISHED : 0;
        default:
            return SSE_USAGE;
        }
    }
    return 0;
}

static inline uint32_t load4(const char *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

#define FOUR(a, b, c, d) ((uint32_t)(unsigned char)(a) | (uint32_t)(unsigned char)(b) << 8 | \
                          (uint32_t)(unsigned char)(c) << 16 | (uint32_t)(unsigned char)(d) << 24)

/* Whether the bytes at k begin one of SSE_KEYS: its first four bytes against the prefixes the
 * keys with that first letter have (a filter before match_key; little-endian loads). */
static inline int key_prefix(const char *k)
{
    uint32_t v = load4(k);
    switch (*k) {
    case 'c': return v == FOUR('c', 't', 'x', '_') || v == FOUR('c', 'o', 'm', 'p');
    case 'd': return v == FOUR('d', 'i', 's', 'a');
    case 'e': return v == FOUR('e', 'n', 'c', 'o') || v == FOUR('e', 'r', 'r', 'o');
    case 'f': return v == FOUR('f', 'i', 'r', 's') || v == FOUR('f', 'i', 'n', 'i');
    case 'k': return v == FOUR('k', 'v', '_', 't');
    case 'p': return v == FOUR('p', 'r', 'o', 'm');
    default: return 0;
    }
}

static int scan(const char *s, Py_ssize_t n)
{
    /* A plain byte loop: quotes are dense in JSON (one every 5-6 bytes), so a memchr call per
     * quote costs more than it saves. A '"' is looked at further only when the 4 bytes after it
     * begin a key of interest. */
    const char *end = s + n;
    int flags = 0;
    for (const char *p = s; p + 5 < end; p++) {
        if (*p == '"' && key_prefix(p + 1))
            flags |= match_key(p + 1, end, &p);
    }
    return flags;
}

/* The end of the last complete SSE event in s[0:n] (just past its blank line, "\n\n" or
 * "\r\n\r\n"), or 0 if none is complete. */
static Py_ssize_t events_end(const char *s, Py_ssize_t n)
{
    for (Py_ssize_t i = n - 1; i > 0; i--) {
        if (s[i] == '\n' && (s[i - 1] == '\n' || (i >= 3 && s[i - 1] == '\r' && s[i - 2] == '\n' && s[i - 3] == '\r')))
            return i + 1;
    }
    return 0;
}

#define DONE_EVENT "data: [DONE]\n\n"

/* sse_scan(data: bytes) -> int: (end << 8) | bits, where end is events_end(data) and bits are
 * the SSE_* flags of data[:end] (see the header comment), plus SSE_DONE when data[:end] ends with
 * the `data: [DONE]` event. */
PyObject *mod_sse_scan(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "sse_scan(data) takes one bytes argument");
        return NULL;
    }
    const char *s = PyBytes_AS_STRING(args[0]);
    Py_ssize_t end = events_end(s, PyBytes_GET_SIZE(args[0]));
    int flags = scan(s, end);
    Py_ssize_t dl = (Py_ssize_t)sizeof(DONE_EVENT) - 1;
    if (end >= dl && memcmp(s + end - dl, DONE_EVENT, (size_t)dl) == 0)
        flags |= SSE_DONE;
    return PyLong_FromSsize_t(end << 8 | flags);
}
