"""The operator console: a read-only web UI of the fleet and of the cluster it
runs, ``python -m console web``.

It sits above the packages it shows: it reads the BMDB through `bmdb` and
asks the cluster through `metropolis.owner`, and neither imports it
(`tests/test_package_layers.py` checks the direction).

Server-rendered HTML (Jinja2 templates, autoescaped), no JavaScript, served
by the bounded HTTP/1.1 transport of the metrics endpoint (`common.httpserver`:
head timeout, a deadline on each answer, a cap on connections) in the same
Trio run as the BMDB connection::

    common.httpserver ─ asgi.App ─ GET /machines?state=&provider=&after=
                                      overview.machines        (1 statement)
                                      counts.CountsCache       (overview.state_counts:
                                        at most once per 5 s, shared, in its nursery)
                                  GET /machine/ID
                                      overview.machine         (3 statements)
                                  GET /sessions
                                      overview.activity        (2 statements)
                                  GET /cluster, /cluster/node/ID[/tree]
                                      cluster.ClusterView      (1 or 2 RPCs, and
                                      overview.machines_of_nodes: 1 statement)
                       each returns a render.Page; asgi renders its template
                       (templates/*.html, every value escaped)

Nothing writes to the BMDB and nothing secret is shown (agent keys are
public keys; a hardware report shows what the agent found, its CPUs,
memory, disks and NICs, decoded by `common.hwreport`). The cluster half
(nodes, roles, leader, a node's supervision tree) is served by the same
server, as the cluster's owner, when it is given the owner's files: one UI
and one navigation for the fleet and the cluster it runs.

Modules: `render` (the Jinja2 environment: the templates in ``templates/``,
compiled once, autoescaped, and the texts they compute), `charts` (the SVG
charts' geometry), `pages` (one function per BMDB page), `audit` (the
audit page), `guidance` (the first page's next step), `counts` (the
machine list's counts per state, taken at most once per period and shared
by requests), `cluster` (the cluster pages), `asgi` (routing, errors,
headers), `server` (the app on `common.httpserver`), `errors` (the console's error
tree), `__main__` (the command).

A machine asked to install an OS shows its installation state with its
generation (``installed@2``) in the list (filterable by installation
state) and the request and report on its page; an installed machine links
to its node's cluster page, and a node's pages link back to the machine
whose install report carries the node's public key.
"""
