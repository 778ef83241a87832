"""Ponytail's serving: `api/`, the HTTP API (OpenAI, Anthropic and Responses shapes; no Ray), and
`app/`, the Ray Serve application on top of it (`serve run deployments/app.yaml`). Imports run one
way: app -> api -> ponytail (its public names); the library never imports either."""
