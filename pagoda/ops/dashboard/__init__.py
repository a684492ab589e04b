"""The operator dashboard: `GET /dashboard` (a page shipped in `static/`, plain JS and SVG, nothing
fetched from elsewhere), the JSON it polls (`/dashboard/snapshot`, computed from the same registry
as /metrics), and a request's waterfall (`/dashboard/requests/{id}/waterfall`). `pagoda top` reads
the same snapshot in a terminal."""
