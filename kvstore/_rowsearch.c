/* The loops over every pushed row id: a server's check, search and write of a push, a
 * worker's split by server, each in one pass instead of NumPy's several (kvstore/rowsearch.py
 * is the interface and the NumPy reference: read it first).
 *
 *   check(ids, rows, num_server, server)  0: sorted, unique, in [0, rows) and, with
 *                                         num_server > 1, every id this server's (the hash
 *                                         of sharding.row_server); 1: not sorted, unique
 *                                         and in range; 2: an id of another server
 *   find(stored, slots, ids, out)         out[i] = slots[j] where stored[j] == ids[i], else
 *                                         -1; returns how many were found. ``stored`` is
 *                                         sorted; ``ids`` any order, fastest sorted: each
 *                                         search gallops on from the last one's place
 *                                         instead of a fresh binary search of the table.
 *   assign(stored, slots, ids, rows, block, changed, step, again, where, flags)
 *                                         find's search (or a direct map's lookup), and in
 *                                         the same pass each found row written into the
 *                                         block and marked changed at ``step`` (with
 *                                         ``again``, a row marked so already is left as it
 *                                         is and flagged): a round's push without an
 *                                         optimizer, see rowsearch.assign.
 *   split(ids, num_server, order, starts) the positions of each server's ids (row_server),
 *                                         in the order of ``ids``: server s's are
 *                                         order[starts[s]:starts[s + 1]] (a counting sort).
 *
 * The arrays come through the buffer protocol (no NumPy headers at build time): int64 ids
 * and positions, int32 slots and steps, C-contiguous; take_buffer refuses any other type,
 * and each function checks the sizes. Rows and the block are moved as bytes (any dtype:
 * rowsearch.assign gives rows of the block's). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* sharding.row_server: a Fibonacci hash of the id's 64 bits, its upper half, mod servers
 * (at most 2**31 of them). The remainder by Lemire's exact 32-bit fastmod (two multiplies;
 * a division takes several times as long, and each id needs one, twice in split) */
typedef struct {
    uint64_t magic; /* 2**64 / count, rounded up */
    uint32_t count;
} Servers;

static inline Servers servers_of(long long num_server)
{
    Servers s = {UINT64_MAX / (uint32_t)num_server + 1, (uint32_t)num_server};
    return s;
}

static inline uint32_t row_server(int64_t id, Servers s)
{
    uint32_t mixed = (uint32_t)(((uint64_t)id * 0x9E3779B97F4A7C15ULL) >> 32);
    return (uint32_t)(((__uint128_t)(s.magic * mixed) * s.count) >> 64);
}

/* A C-contiguous buffer of native signed integers of ``itemsize`` bytes (int64 or int32):
 * anything else (floats, unsigned, the other width, big-endian) is refused, not misread. */
static int take_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, int writable,
                       const char *what)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    const char *format = view->format ? view->format : "B";
    if (*format == '@' || *format == '=' || *format == '<')
        format++;
    int integer = format[0] && !format[1] && strchr(itemsize == 8 ? "lq" : "i", format[0]);
    if (!integer || view->itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s: expected %s, got items of format '%s' (%zd bytes)",
                     what, itemsize == 8 ? "int64" : "int32",
                     view->format ? view->format : "B", view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *check(PyObject *self, PyObject *args)
{
    PyObject *obj;
    long long rows, num_server, server;
    Py_buffer ids;
    if (!PyArg_ParseTuple(args, "OLLL", &obj, &rows, &num_server, &server))
        return NULL;
    if (num_server < 1 || num_server > (1LL << 31)) {
        PyErr_SetString(PyExc_ValueError, "num_server must be in [1, 2**31]");
        return NULL;
    }
    if (take_buffer(obj, &ids, 8, 0, "ids") < 0)
        return NULL;
    const int64_t *id = ids.buf;
    Py_ssize_t n = ids.len / 8;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    if (n && (id[0] < 0 || id[n - 1] >= rows))
        bad = 1;
    for (Py_ssize_t i = 1; i < n && !bad; i++)
        if (id[i] <= id[i - 1])
            bad = 1;
    Servers servers = servers_of(num_server);
    if (!bad && num_server > 1)
        for (Py_ssize_t i = 0; i < n; i++)
            if (row_server(id[i], servers) != server) {
                bad = 2;
                break;
            }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&ids);
    return PyLong_FromLong(bad);
}

/* The place of ``x`` in the sorted ``a`` (n of them), or -1: a gallop on from ``*lo`` (the
 * last search's place, where ``a[*lo - 1] < x`` held for the id before, ``prev``; afresh
 * when ``x`` is smaller than it: unsorted ids), then a binary search. */
static inline Py_ssize_t gallop(const int64_t *a, Py_ssize_t n, int64_t x, int64_t prev,
                                Py_ssize_t *lo_at)
{
    Py_ssize_t lo = x < prev ? 0 : *lo_at, hi = lo, stride = 1;
    while (hi < n && a[hi] < x) {
        lo = hi + 1;
        hi = stride < n - hi ? hi + stride : n;
        stride <<= 1;
    }
    while (lo < hi) {
        Py_ssize_t mid = lo + ((hi - lo) >> 1);
        if (a[mid] < x)
            lo = mid + 1;
        else
            hi = mid;
    }
    *lo_at = lo;
    return lo < n && a[lo] == x ? lo : -1;
}

static PyObject *find(PyObject *self, PyObject *args)
{
    PyObject *objs[4];
    Py_buffer stored, slots, ids, out;
    Py_ssize_t found = -1; /* -1: an error is set */
    if (!PyArg_ParseTuple(args, "OOOO", &objs[0], &objs[1], &objs[2], &objs[3]))
        return NULL;
    if (take_buffer(objs[0], &stored, 8, 0, "stored") < 0)
        return NULL;
    if (take_buffer(objs[1], &slots, 4, 0, "slots") < 0)
        goto stored_only;
    if (take_buffer(objs[2], &ids, 8, 0, "ids") < 0)
        goto slots_too;
    if (take_buffer(objs[3], &out, 4, 1, "out") < 0)
        goto ids_too;
    Py_ssize_t n = stored.len / 8, m = ids.len / 8;
    if (slots.len / 4 != n || out.len / 4 != m) {
        PyErr_Format(PyExc_ValueError,
                     "find: %zd stored ids need as many slots (got %zd), %zd ids as many outs "
                     "(got %zd)", n, slots.len / 4, m, out.len / 4);
        goto all;
    }
    const int64_t *a = stored.buf, *q = ids.buf;
    const int32_t *s = slots.buf;
    int32_t *o = out.buf;
    found = 0;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t lo = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        Py_ssize_t at = gallop(a, n, q[i], i ? q[i - 1] : q[i], &lo);
        if (at >= 0) {
            o[i] = s[at];
            found++;
        } else {
            o[i] = -1;
        }
    }
    Py_END_ALLOW_THREADS
all:
    PyBuffer_Release(&out);
ids_too:
    PyBuffer_Release(&ids);
slots_too:
    PyBuffer_Release(&slots);
stored_only:
    PyBuffer_Release(&stored);
    return found < 0 ? NULL : PyLong_FromSsize_t(found);
}

/* Any C-contiguous buffer (the rows and the block: any dtype; moved as bytes). */
static int take_bytes(PyObject *obj, Py_buffer *view, int writable)
{
    return PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0));
}

/* assign(stored, slots, ids, rows, block, changed, step, again, where, flags): a round's
 * push written into the table in the same pass as its search. For each id (unique; sorted
 * is the fast case): its slot (stored None: ``slots`` is the direct map, slot + 1 per id, 0
 * absent) into where[i], or -1 and flags[i] = 1 when absent; with ``again`` a row found
 * with changed[slot] == step (an earlier push of the round wrote it) is left as it is,
 * flags[i] = 2; any other found row gets rows[i] (rowbytes bytes), changed[slot] = step,
 * flags[i] = 0. Returns (found, again). */
static PyObject *assign(PyObject *self, PyObject *args)
{
    PyObject *stored_obj, *objs[7];
    long long step;
    int check_again;
    Py_buffer views[8];
    memset(views, 0, sizeof views);
    Py_buffer *stored = &views[0], *slots = &views[1], *ids = &views[2], *rows = &views[3];
    Py_buffer *block = &views[4], *changed = &views[5], *where = &views[6], *flags = &views[7];
    Py_ssize_t found = -1, again = 0; /* found -1: an error is set */
    if (!PyArg_ParseTuple(args, "OOOOOOLpOO", &stored_obj, &objs[0], &objs[1], &objs[2],
                          &objs[3], &objs[4], &step, &check_again, &objs[5], &objs[6]))
        return NULL;
    if (stored_obj != Py_None && take_buffer(stored_obj, stored, 8, 0, "stored") < 0)
        return NULL;
    if (take_buffer(objs[0], slots, 4, 0, "slots") < 0 ||
        take_buffer(objs[1], ids, 8, 0, "ids") < 0 || take_bytes(objs[2], rows, 0) < 0 ||
        take_bytes(objs[3], block, 1) < 0 || take_buffer(objs[4], changed, 4, 1, "changed") < 0 ||
        take_buffer(objs[5], where, 4, 1, "where") < 0 || take_bytes(objs[6], flags, 1) < 0)
        goto done;
    Py_ssize_t n = stored->obj ? stored->len / 8 : 0, m = ids->len / 8;
    Py_ssize_t slot_count = changed->len / 4;
    /* the block has a row per entry of ``changed`` (they grow together): its row's bytes
     * (an empty table has none: every id is absent, and a slot found is refused) */
    Py_ssize_t rowbytes = slot_count ? block->len / slot_count : 0;
    if ((stored->obj && slots->len / 4 != n) || where->len / 4 != m || flags->len != m ||
        (slot_count && (block->len % slot_count || rows->len != m * rowbytes))) {
        PyErr_Format(PyExc_ValueError,
                     "assign: %zd stored ids need as many slots (got %zd); %zd ids need as many "
                     "wheres (got %zd), flags (got %zd) and rows of the block's (got %zd bytes); "
                     "the block (%zd bytes) needs a row per changed entry (%zd)", n,
                     slots->len / 4, m, where->len / 4, flags->len, rows->len, block->len,
                     slot_count);
        goto done;
    }
    const int64_t *a = stored->buf, *q = ids->buf;
    const int32_t *s = slots->buf;
    const char *src = rows->buf;
    char *dst = block->buf;
    int32_t *c = changed->buf, *o = where->buf;
    uint8_t *f = flags->buf;
    Py_ssize_t direct = slots->len / 4;
    int sorted = stored->obj != NULL;
    int bad = 0;
    found = 0;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t lo = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        int64_t x = q[i];
        int32_t slot = -1;
        if (!sorted) {
            if (x < 0 || x >= direct) {
                bad = 1;
                break;
            }
            slot = s[x] - 1;
        } else {
            Py_ssize_t at = gallop(a, n, x, i ? q[i - 1] : x, &lo);
            if (at >= 0)
                slot = s[at];
        }
        o[i] = slot;
        if (slot < 0) {
            f[i] = 1;
            continue;
        }
        if (slot >= slot_count) {
            bad = 2;
            break;
        }
        found++;
        if (check_again && c[slot] == step) {
            f[i] = 2;
            again++;
            continue;
        }
        memcpy(dst + slot * rowbytes, src + i * rowbytes, rowbytes);
        c[slot] = (int32_t)step;
        f[i] = 0;
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_ValueError, bad == 1 ? "assign: an id outside the direct map"
                                                   : "assign: a slot outside the table");
        found = -1;
    }
done:
    for (int k = 0; k < 8; k++)
        if (views[k].obj)
            PyBuffer_Release(&views[k]);
    return found < 0 ? NULL : Py_BuildValue("nn", found, again);
}

static PyObject *split(PyObject *self, PyObject *args)
{
    PyObject *objs[3];
    long long num_server;
    Py_buffer ids, order, starts;
    if (!PyArg_ParseTuple(args, "OLOO", &objs[0], &num_server, &objs[1], &objs[2]))
        return NULL;
    if (num_server < 1 || num_server > (1LL << 31)) {
        PyErr_SetString(PyExc_ValueError, "num_server must be in [1, 2**31]");
        return NULL;
    }
    if (take_buffer(objs[0], &ids, 8, 0, "ids") < 0)
        return NULL;
    if (take_buffer(objs[1], &order, 8, 1, "order") < 0) {
        PyBuffer_Release(&ids);
        return NULL;
    }
    if (take_buffer(objs[2], &starts, 8, 1, "starts") < 0) {
        PyBuffer_Release(&order);
        PyBuffer_Release(&ids);
        return NULL;
    }
    Py_ssize_t n = ids.len / 8;
    int ok = order.len / 8 == n && starts.len / 8 == num_server + 1;
    if (!ok)
        PyErr_Format(PyExc_ValueError,
                     "split: %zd ids need as many positions (got %zd), %lld servers %lld "
                     "starts (got %zd)", n, order.len / 8, num_server, num_server + 1,
                     starts.len / 8);
    else {
        const int64_t *id = ids.buf;
        int64_t *o = order.buf, *start = starts.buf;
        Servers servers = servers_of(num_server);
        Py_BEGIN_ALLOW_THREADS
        for (long long k = 0; k <= num_server; k++)
            start[k] = 0;
        for (Py_ssize_t i = 0; i < n; i++)
            start[row_server(id[i], servers) + 1]++;
        for (long long k = 0; k < num_server; k++)
            start[k + 1] += start[k];
        if (num_server == 2) { /* the two places in registers: no chain through memory */
            int64_t *first = o, *second = o + start[1];
            for (Py_ssize_t i = 0; i < n; i++) {
                uint32_t s = row_server(id[i], servers);
                *(s ? second : first) = i;
                first += !s;
                second += s;
            }
        } else { /* start[k]: server k's next free place while filling, its end after */
            for (Py_ssize_t i = 0; i < n; i++)
                o[start[row_server(id[i], servers)]++] = i;
            for (long long k = num_server; k > 0; k--)
                start[k] = start[k - 1];
            start[0] = 0;
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&starts);
    PyBuffer_Release(&order);
    PyBuffer_Release(&ids);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"check", check, METH_VARARGS,
     "check(ids, rows, num_server, server) -> 0 (good), 1 (order or range), 2 (server)"},
    {"find", find, METH_VARARGS, "find(stored, slots, ids, out) -> found; out[i] = slot or -1"},
    {"assign", assign, METH_VARARGS,
     "assign(stored, slots, ids, rows, block, changed, step, again, where, flags) -> "
     "(found, again): the rows written where found (and, with again, not written this step)"},
    {"split", split, METH_VARARGS,
     "split(ids, num_server, order, starts): server s's positions are "
     "order[starts[s]:starts[s + 1]]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvstore._rowsearch",
    "Row-sparse id checks and lookups in C (kvstore.rowsearch has the NumPy reference).", -1,
    methods,
};

/* API: what kvstore.rowsearch expects (rowsearch.API there); a change of any function's
 * arguments or answers raises it, so an old build left in a tree is not called wrongly */
PyMODINIT_FUNC PyInit__rowsearch(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "API", 2) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
