/* syncwatch.instrument._cnotes: the training thread's notes, in C.
 *
 * The same four classes as notes.py -- Notes, its Phase context managers, Mark and Relay
 * callbacks -- with the same behaviour: each call appends one entry, a tuple of an entry code and a clock
 * mark, to the monitor's deque. notes.py is the reference and what runs where this module was
 * not built. It exists because after a backward pass the interpreter's caches are cold and every
 * Python frame costs 1-3 us; a call into these types costs no Python frame at all.
 *
 * A Notes object is bound to a monitor with bind(put, clock, on_error): put appends an entry,
 * clock() returns a mark, on_error(exc) counts an exception raised by either. The three are kept
 * as one tuple, read once per call, so that a bind() on another thread is seen whole or not at
 * all. Unbound, every call does nothing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef struct {
    PyObject_HEAD
    PyObject *to;         /* (put, clock, on_error), or NULL: unbound */
    PyObject *step_code;  /* the entry code of step() */
    PyObject *wall;       /* () -> wall-clock time of a step's end (time.time) */
} NotesObject;

/* A phase (codes noted on __enter__ and __exit__) or a mark (code noted when called; exit_code
 * NULL): the two share their layout and their reference handling. */
typedef struct {
    PyObject_HEAD
    NotesObject *notes;
    PyObject *code;       /* noted on __enter__ (phase) or when called (mark) */
    PyObject *exit_code;  /* noted on __exit__ (phase); NULL for a mark */
} NoteObject;

/* A relay: calls first(), then notes (code, clock(), extra). */
typedef struct {
    PyObject_HEAD
    NotesObject *notes;
    PyObject *code;
    PyObject *extra;
    PyObject *first;
} RelayObject;

static PyObject *zero;  /* step()'s default sample count */

/* Like `except Exception as e: on_error(e)`: an Exception is handed to on_error and goes no
 * further; any other BaseException (KeyboardInterrupt, SystemExit) propagates. */
static int
failed(PyObject *to)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception)) {
        return -1;
    }
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *exc = PyErr_GetRaisedException();
#else
    PyObject *type, *exc, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    if (tb != NULL) {
        PyException_SetTraceback(exc, tb);
        Py_DECREF(tb);
    }
    Py_XDECREF(type);
#endif
    PyObject *r = PyObject_CallOneArg(PyTuple_GET_ITEM(to, 2), exc);
    Py_DECREF(exc);
    if (r == NULL) {
        return -1;
    }
    Py_DECREF(r);
    return 0;
}

/* Append `entry` (a new reference, or NULL when building it failed) with `to`'s put. */
static int
put(PyObject *to, PyObject *entry)
{
    if (entry != NULL) {
        PyObject *r = PyObject_CallOneArg(PyTuple_GET_ITEM(to, 0), entry);
        Py_DECREF(entry);
        if (r != NULL) {
            Py_DECREF(r);
            return 0;
        }
    }
    return failed(to);
}

/* Append (code, clock()). 0, or -1 with a BaseException set that must propagate. */
static int
note(NotesObject *n, PyObject *code)
{
    PyObject *to = n != NULL ? n->to : NULL;  /* n is NULL only once the GC cleared a cycle */
    if (to == NULL) {
        return 0;
    }
    Py_INCREF(to);  /* clock() may run Python code, during which another thread may rebind */
    PyObject *entry = NULL;
    PyObject *mark = PyObject_CallNoArgs(PyTuple_GET_ITEM(to, 1));
    if (mark != NULL) {
        entry = PyTuple_Pack(2, code, mark);
        Py_DECREF(mark);
    }
    int rc = put(to, entry);
    Py_DECREF(to);
    return rc;
}

/* ------------------------------------------------------------------------------ Notes */

static int
notes_init(NotesObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"step_code", "wall", NULL};
    PyObject *step_code, *wall;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO:Notes", kwlist, &step_code, &wall)) {
        return -1;
    }
    if (!PyCallable_Check(wall)) {
        PyErr_SetString(PyExc_TypeError, "Notes: wall must be callable");
        return -1;
    }
    Py_CLEAR(self->to);  /* notes.py's __init__ starts unbound: `self._to = None` */
    Py_INCREF(step_code);
    Py_XSETREF(self->step_code, step_code);
    Py_INCREF(wall);
    Py_XSETREF(self->wall, wall);
    return 0;
}

static PyObject *
notes_bind(NotesObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"put", "clock", "on_error", NULL};
    PyObject *p = Py_None, *clock = Py_None, *on_error = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|OOO:bind", kwlist, &p, &clock, &on_error)) {
        return NULL;
    }
    PyObject *to = NULL;
    if (p != Py_None) {
        if (!PyCallable_Check(p) || !PyCallable_Check(clock) || !PyCallable_Check(on_error)) {
            PyErr_SetString(PyExc_TypeError, "bind: put, clock and on_error must be callable");
            return NULL;
        }
        to = PyTuple_Pack(3, p, clock, on_error);
        if (to == NULL) {
            return NULL;
        }
    }
    Py_XSETREF(self->to, to);
    Py_RETURN_NONE;
}

static PyObject *
notes_bound(NotesObject *self, void *closure)
{
    return PyBool_FromLong(self->to != NULL);
}

static PyObject *
notes_step(NotesObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *names[] = {"samples", "tokens", "step"};
    PyObject *v[3] = {zero, Py_None, Py_None};
    if (nargs > 3) {
        PyErr_Format(PyExc_TypeError, "step() takes at most 3 arguments (%zd given)", nargs);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        v[i] = args[i];
    }
    Py_ssize_t nkw = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int i = 0;
        while (i < 3 && PyUnicode_CompareWithASCIIString(key, names[i]) != 0) {
            i++;
        }
        if (i == 3) {
            PyErr_Format(PyExc_TypeError, "step() got an unexpected keyword argument %R", key);
            return NULL;
        }
        if (i < nargs) {
            PyErr_Format(PyExc_TypeError, "step() got multiple values for argument '%s'",
                         names[i]);
            return NULL;
        }
        v[i] = args[nargs + k];
    }
    PyObject *to = self->to;
    if (to == NULL) {
        Py_RETURN_NONE;
    }
    Py_INCREF(to);
    PyObject *entry = NULL, *wall = NULL, *mark = NULL;
    if (self->wall == NULL) {  /* bound, but __init__ never ran (Notes.__new__ alone) */
        PyErr_SetString(PyExc_TypeError, "Notes.__init__ was not called");
    }
    else {
        mark = PyObject_CallNoArgs(PyTuple_GET_ITEM(to, 1));
    }
    if (mark != NULL) {
        wall = PyObject_CallNoArgs(self->wall);
        if (wall != NULL) {
            entry = PyTuple_Pack(6, self->step_code, mark, wall, v[0], v[1], v[2]);
            Py_DECREF(wall);
        }
        Py_DECREF(mark);
    }
    int rc = put(to, entry);
    Py_DECREF(to);
    if (rc < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyTypeObject PhaseType, MarkType, RelayType;

static PyObject *
new_note(PyTypeObject *type, NotesObject *notes, PyObject *code, PyObject *exit_code)
{
    NoteObject *n = PyObject_GC_New(NoteObject, type);
    if (n == NULL) {
        return NULL;
    }
    Py_INCREF(notes);
    n->notes = notes;
    Py_INCREF(code);
    n->code = code;
    Py_XINCREF(exit_code);
    n->exit_code = exit_code;
    PyObject_GC_Track(n);
    return (PyObject *)n;
}

/* phase(), mark() and relay() take their arguments by position or keyword, as in notes.py; they
 * build an object once (at import, a monitor's start, or a watched model's first backwards once
 * DDP's bucket count is read), not per call, so they need no fast calling. */
static PyObject *
notes_phase(NotesObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"start", "end", NULL};
    PyObject *start, *end;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO:phase", kwlist, &start, &end)) {
        return NULL;
    }
    return new_note(&PhaseType, self, start, end);
}

static PyObject *
notes_mark(NotesObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"code", NULL};
    PyObject *code;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:mark", kwlist, &code)) {
        return NULL;
    }
    return new_note(&MarkType, self, code, NULL);
}

static PyObject *
notes_relay(NotesObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"code", "extra", "first", NULL};
    PyObject *code, *extra, *first;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO:relay", kwlist, &code, &extra, &first)) {
        return NULL;
    }
    if (!PyCallable_Check(first)) {
        PyErr_SetString(PyExc_TypeError, "relay: first must be callable");
        return NULL;
    }
    RelayObject *r = PyObject_GC_New(RelayObject, &RelayType);
    if (r == NULL) {
        return NULL;
    }
    Py_INCREF(self);
    r->notes = self;
    r->code = Py_NewRef(code);
    r->extra = Py_NewRef(extra);
    r->first = Py_NewRef(first);
    PyObject_GC_Track(r);
    return (PyObject *)r;
}

static int
notes_traverse(NotesObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->to);
    Py_VISIT(self->step_code);
    Py_VISIT(self->wall);
    return 0;
}

static int
notes_clear(NotesObject *self)
{
    Py_CLEAR(self->to);
    Py_CLEAR(self->step_code);
    Py_CLEAR(self->wall);
    return 0;
}

static void
notes_dealloc(NotesObject *self)
{
    PyObject_GC_UnTrack(self);
    notes_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef notes_methods[] = {
    {"bind", (PyCFunction)(void (*)(void))notes_bind, METH_VARARGS | METH_KEYWORDS,
     "bind(put=None, clock=None, on_error=None): report to put/clock/on_error; "
     "without put, unbind (every call does nothing)."},
    {"step", (PyCFunction)(void (*)(void))notes_step, METH_FASTCALL | METH_KEYWORDS,
     "step(samples=0, tokens=None, step=None): end a step that processed samples (and tokens);\n"
     "step = the job's own step number (default: the previous one + 1)."},
    {"phase", (PyCFunction)(void (*)(void))notes_phase, METH_VARARGS | METH_KEYWORDS,
     "phase(start, end): a context manager noting start on entry and end on exit."},
    {"mark", (PyCFunction)(void (*)(void))notes_mark, METH_VARARGS | METH_KEYWORDS,
     "mark(code): a callable (any arguments, ignored) noting code."},
    {"relay", (PyCFunction)(void (*)(void))notes_relay, METH_VARARGS | METH_KEYWORDS,
     "relay(code, extra, first): a callable (any arguments, ignored) that calls first(), then\n"
     "notes code with extra: (code, mark, extra). If first raises, nothing is noted."},
    {NULL}
};

static PyGetSetDef notes_getset[] = {
    {"bound", (getter)notes_bound, NULL, "whether calls are noted", NULL},
    {NULL}
};

static PyTypeObject NotesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "syncwatch.instrument._cnotes.Notes",
    .tp_doc = "Notes(step_code, wall): where the training thread's calls note entries.",
    .tp_basicsize = sizeof(NotesObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)notes_init,
    .tp_dealloc = (destructor)notes_dealloc,
    .tp_traverse = (traverseproc)notes_traverse,
    .tp_clear = (inquiry)notes_clear,
    .tp_methods = notes_methods,
    .tp_getset = notes_getset,
};

/* ------------------------------------------------------------------------------ Phase, Mark */

static int
note_traverse(NoteObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->notes);
    Py_VISIT(self->code);
    Py_VISIT(self->exit_code);
    return 0;
}

static int
note_clear(NoteObject *self)
{
    Py_CLEAR(self->notes);
    Py_CLEAR(self->code);
    Py_CLEAR(self->exit_code);
    return 0;
}

static void
note_dealloc(NoteObject *self)
{
    PyObject_GC_UnTrack(self);
    note_clear(self);
    PyObject_GC_Del(self);
}

static PyObject *
phase_enter(NoteObject *self, PyObject *unused)
{
    if (note(self->notes, self->code) < 0) {
        return NULL;
    }
    Py_INCREF(self);
    return (PyObject *)self;
}

static PyObject *
phase_exit(NoteObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError,
                     "__exit__() takes 3 arguments (exc_type, exc, tb) (%zd given)", nargs);
        return NULL;
    }
    if (note(self->notes, self->exit_code) < 0) {
        return NULL;
    }
    Py_RETURN_FALSE;  /* never swallow the training code's exceptions */
}

static PyMethodDef phase_methods[] = {
    {"__enter__", (PyCFunction)phase_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))phase_exit, METH_FASTCALL, NULL},
    {NULL}
};

static PyTypeObject PhaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "syncwatch.instrument._cnotes.Phase",
    .tp_doc = "A phase's context manager (Notes.phase).",
    .tp_basicsize = sizeof(NoteObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_dealloc = (destructor)note_dealloc,
    .tp_traverse = (traverseproc)note_traverse,
    .tp_clear = (inquiry)note_clear,
    .tp_methods = phase_methods,
};

static PyObject *
mark_call(NoteObject *self, PyObject *args, PyObject *kwds)
{
    if (note(self->notes, self->code) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyTypeObject MarkType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "syncwatch.instrument._cnotes.Mark",
    .tp_doc = "A callback noting its code (Notes.mark); its arguments are ignored.",
    .tp_basicsize = sizeof(NoteObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_call = (ternaryfunc)mark_call,
    .tp_dealloc = (destructor)note_dealloc,
    .tp_traverse = (traverseproc)note_traverse,
    .tp_clear = (inquiry)note_clear,
};

/* ------------------------------------------------------------------------------ Relay */

static int
relay_traverse(RelayObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->notes);
    Py_VISIT(self->code);
    Py_VISIT(self->extra);
    Py_VISIT(self->first);
    return 0;
}

static int
relay_clear(RelayObject *self)
{
    Py_CLEAR(self->notes);
    Py_CLEAR(self->code);
    Py_CLEAR(self->extra);
    Py_CLEAR(self->first);
    return 0;
}

static void
relay_dealloc(RelayObject *self)
{
    PyObject_GC_UnTrack(self);
    relay_clear(self);
    PyObject_GC_Del(self);
}

static PyObject *
relay_call(RelayObject *self, PyObject *args, PyObject *kwds)
{
    PyObject *to = self->notes != NULL ? self->notes->to : NULL;
    if (to == NULL || self->first == NULL) {
        Py_RETURN_NONE;
    }
    Py_INCREF(to);  /* first() and clock() may run Python code, during which a rebind may come */
    PyObject *entry = NULL;
    PyObject *r = PyObject_CallNoArgs(self->first);
    if (r != NULL) {
        Py_DECREF(r);
        PyObject *mark = PyObject_CallNoArgs(PyTuple_GET_ITEM(to, 1));
        if (mark != NULL) {
            entry = PyTuple_Pack(3, self->code, mark, self->extra);
            Py_DECREF(mark);
        }
    }
    int rc = put(to, entry);
    Py_DECREF(to);
    if (rc < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyTypeObject RelayType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "syncwatch.instrument._cnotes.Relay",
    .tp_doc = "A callback that calls first() and notes its code and extra (Notes.relay); its "
              "arguments are ignored.",
    .tp_basicsize = sizeof(RelayObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_call = (ternaryfunc)relay_call,
    .tp_dealloc = (destructor)relay_dealloc,
    .tp_traverse = (traverseproc)relay_traverse,
    .tp_clear = (inquiry)relay_clear,
};

/* ------------------------------------------------------------------------------ module */

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "syncwatch.instrument._cnotes",
    .m_doc = "The training thread's notes in C: the same classes as syncwatch.instrument.notes.",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__cnotes(void)
{
    if (PyType_Ready(&NotesType) < 0 || PyType_Ready(&PhaseType) < 0
            || PyType_Ready(&MarkType) < 0 || PyType_Ready(&RelayType) < 0) {
        return NULL;
    }
    zero = PyLong_FromLong(0);
    if (zero == NULL) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "Notes", (PyObject *)&NotesType) < 0
            || PyModule_AddObjectRef(m, "Phase", (PyObject *)&PhaseType) < 0
            || PyModule_AddObjectRef(m, "Mark", (PyObject *)&MarkType) < 0
            || PyModule_AddObjectRef(m, "Relay", (PyObject *)&RelayType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
