import json
S = "string"
def obj(props, req=None, **kw):
    d = {"type": "object", "properties": props}
    d["required"] = list(props) if req is None else req
    d.update(kw); return d
def s(**kw): return {"type": "string", **kw}
def i(**kw): return {"type": "integer", **kw}
def n(**kw): return {"type": "number", **kw}
def b(): return {"type": "boolean"}
def arr(items, **kw): return {"type": "array", "items": items, **kw}
name = s(maxLength=40)
schemas = [
 ("github_user", "a GitHub user", obj({"login": s(maxLength=39, pattern="^[a-z0-9-]+$"), "id": i(minimum=1), "site_admin": b(), "type": {"enum": ["User", "Organization", "Bot"]}}, additionalProperties=False)),
 ("github_issue", "a GitHub issue", obj({"number": i(minimum=1), "title": s(maxLength=60), "state": {"enum": ["open", "closed"]}, "labels": arr(obj({"name": s(maxLength=20), "color": s(pattern="^[0-9a-f]{6}$")}, additionalProperties=False), maxItems=3)}, additionalProperties=False)),
 ("github_repo", "a GitHub repository", obj({"full_name": s(maxLength=60), "private": b(), "stargazers_count": i(minimum=0), "topics": arr(s(maxLength=20), maxItems=4), "license": {"anyOf": [obj({"spdx_id": s(maxLength=20)}, additionalProperties=False), {"type": "null"}]}}, additionalProperties=False)),
 ("github_commit", "a git commit", obj({"sha": s(pattern="^[0-9a-f]{40}$"), "message": s(maxLength=72), "author": obj({"name": name, "email": s(format="email", maxLength=50)}, additionalProperties=False)}, additionalProperties=False)),
 ("github_pull_request", "a pull request", obj({"number": i(minimum=1), "draft": b(), "merged": b(), "head": obj({"ref": s(maxLength=40)}, additionalProperties=False), "base": obj({"ref": s(maxLength=40)}, additionalProperties=False)}, additionalProperties=False)),
 ("k8s_container_port", "a Kubernetes container port", obj({"name": s(maxLength=15, pattern="^[a-z]([-a-z0-9]*[a-z0-9])?$"), "containerPort": i(minimum=1, maximum=65535), "protocol": {"enum": ["TCP", "UDP", "SCTP"]}}, additionalProperties=False)),
 ("k8s_resource_requirements", "Kubernetes resource limits", obj({"limits": obj({"cpu": s(pattern="^[0-9]{1,4}m?$"), "memory": s(pattern="^[0-9]{1,5}(Mi|Gi)$")}, additionalProperties=False), "requests": obj({"cpu": s(pattern="^[0-9]{1,4}m?$"), "memory": s(pattern="^[0-9]{1,5}(Mi|Gi)$")}, additionalProperties=False)}, additionalProperties=False)),
 ("k8s_object_meta", "Kubernetes object metadata", obj({"name": s(maxLength=63, pattern="^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"), "namespace": s(maxLength=63, pattern="^[a-z0-9-]+$"), "labels": {"type": "object", "additionalProperties": s(maxLength=30), "maxProperties": 3}}, additionalProperties=False)),
 ("k8s_service", "a Kubernetes Service", obj({"apiVersion": {"const": "v1"}, "kind": {"const": "Service"}, "spec": obj({"type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]}, "ports": arr(obj({"port": i(minimum=1, maximum=65535), "targetPort": i(minimum=1, maximum=65535)}, additionalProperties=False), minItems=1, maxItems=2)}, additionalProperties=False)}, additionalProperties=False)),
 ("k8s_deployment_strategy", "a Kubernetes deployment strategy", obj({"type": {"enum": ["RollingUpdate", "Recreate"]}, "rollingUpdate": obj({"maxSurge": {"anyOf": [i(minimum=0), s(pattern="^[0-9]{1,3}%$")]}, "maxUnavailable": {"anyOf": [i(minimum=0), s(pattern="^[0-9]{1,3}%$")]}}, additionalProperties=False)}, ["type"], additionalProperties=False)),
 ("k8s_probe", "a Kubernetes liveness probe", obj({"httpGet": obj({"path": s(pattern="^/[a-z/]{0,30}$"), "port": i(minimum=1, maximum=65535)}, additionalProperties=False), "initialDelaySeconds": i(minimum=0, maximum=600), "periodSeconds": i(minimum=1, maximum=600)}, additionalProperties=False)),
 ("k8s_env_var", "a list of environment variables", arr(obj({"name": s(pattern="^[A-Z_][A-Z0-9_]{0,30}$"), "value": s(maxLength=40)}, additionalProperties=False), minItems=1, maxItems=3)),
 ("openapi_info", "OpenAPI info", obj({"title": s(maxLength=50), "version": s(pattern="^[0-9]+\\.[0-9]+\\.[0-9]+$"), "contact": obj({"email": s(format="email", maxLength=50)}, additionalProperties=False)}, additionalProperties=False)),
 ("openapi_server", "OpenAPI servers", arr(obj({"url": s(format="uri", maxLength=60), "description": s(maxLength=40)}, ["url"], additionalProperties=False), minItems=1, maxItems=2)),
 ("openapi_parameter", "an OpenAPI parameter", obj({"name": s(maxLength=30), "in": {"enum": ["query", "header", "path", "cookie"]}, "required": b(), "schema": obj({"type": {"enum": ["string", "integer", "boolean"]}}, additionalProperties=False)}, additionalProperties=False)),
 ("openapi_error", "an API error response", obj({"error": obj({"code": i(minimum=400, maximum=599), "message": s(maxLength=80), "details": arr(s(maxLength=40), maxItems=2)}, ["code", "message"], additionalProperties=False)}, additionalProperties=False)),
 ("stripe_charge", "a payment charge", obj({"id": s(pattern="^ch_[A-Za-z0-9]{8,24}$"), "amount": i(minimum=50, maximum=99999999), "currency": s(pattern="^[a-z]{3}$"), "paid": b(), "status": {"enum": ["succeeded", "pending", "failed"]}}, additionalProperties=False)),
 ("stripe_customer", "a customer", obj({"id": s(pattern="^cus_[A-Za-z0-9]{8,20}$"), "email": {"anyOf": [s(format="email", maxLength=50), {"type": "null"}]}, "balance": i(), "delinquent": b()}, additionalProperties=False)),
 ("slack_message", "a Slack message", obj({"channel": s(pattern="^C[A-Z0-9]{8,10}$"), "text": s(maxLength=80), "mrkdwn": b()}, additionalProperties=False)),
 ("slack_block", "Slack blocks", arr({"anyOf": [obj({"type": {"const": "section"}, "text": obj({"type": {"enum": ["mrkdwn", "plain_text"]}, "text": s(maxLength=60)}, additionalProperties=False)}, additionalProperties=False), obj({"type": {"const": "divider"}}, additionalProperties=False)]}, minItems=1, maxItems=3)),
 ("geojson_point", "a GeoJSON point", obj({"type": {"const": "Point"}, "coordinates": arr(n(minimum=-180, maximum=180), minItems=2, maxItems=2)}, additionalProperties=False)),
 ("geojson_feature", "a GeoJSON feature", obj({"type": {"const": "Feature"}, "geometry": {"$ref": "#/$defs/point"}, "properties": obj({"name": s(maxLength=40)}, additionalProperties=False)}, additionalProperties=False, **{"$defs": {"point": obj({"type": {"const": "Point"}, "coordinates": arr(n(), minItems=2, maxItems=2)}, additionalProperties=False)}})),
 ("package_json", "a package.json", obj({"name": s(pattern="^[a-z0-9-]{1,30}$"), "version": s(pattern="^[0-9]+\\.[0-9]+\\.[0-9]+$"), "private": b(), "dependencies": {"type": "object", "additionalProperties": s(pattern="^\\^?[0-9]+\\.[0-9]+\\.[0-9]+$"), "maxProperties": 3}}, ["name", "version"], additionalProperties=False)),
 ("docker_compose_service", "a docker-compose service", obj({"image": s(maxLength=50), "ports": arr(s(pattern="^[0-9]{2,5}:[0-9]{2,5}$"), maxItems=3), "restart": {"enum": ["no", "always", "on-failure", "unless-stopped"]}}, additionalProperties=False)),
 ("calendar_event", "a calendar event", obj({"summary": s(maxLength=50), "start": s(pattern="^20[0-9]{2}-[01][0-9]-[0-3][0-9]T[0-2][0-9]:[0-5][0-9]:00Z$"), "end": s(pattern="^20[0-9]{2}-[01][0-9]-[0-3][0-9]T[0-2][0-9]:[0-5][0-9]:00Z$"), "attendees": arr(s(format="email", maxLength=40), maxItems=3)}, additionalProperties=False)),
 ("date_range", "a date range", obj({"from": s(format="date"), "to": s(format="date")}, additionalProperties=False)),
 ("uuid_record", "a record with a UUID", obj({"id": s(format="uuid"), "created": s(format="date-time"), "active": b()}, additionalProperties=False)),
 ("ip_config", "a network interface", obj({"interface": s(pattern="^eth[0-9]$"), "address": s(format="ipv4"), "prefix": i(minimum=0, maximum=32), "gateway": s(format="ipv4")}, additionalProperties=False)),
 ("product", "a product in a shop", obj({"sku": s(pattern="^[A-Z]{3}-[0-9]{4}$"), "name": name, "price": n(minimum=0, maximum=10000), "in_stock": b(), "tags": arr(s(maxLength=15), maxItems=3)}, additionalProperties=False)),
 ("order", "a shop order", obj({"order_id": i(minimum=1), "items": arr(obj({"sku": s(pattern="^[A-Z]{3}-[0-9]{4}$"), "quantity": i(minimum=1, maximum=99)}, additionalProperties=False), minItems=1, maxItems=3), "status": {"enum": ["new", "paid", "shipped", "cancelled"]}}, additionalProperties=False)),
 ("address", "a postal address", obj({"street": s(maxLength=50), "city": s(maxLength=30), "postal_code": s(pattern="^[0-9]{5}$"), "country": s(pattern="^[A-Z]{2}$")}, additionalProperties=False)),
 ("person_with_ref", "a person with addresses", obj({"name": name, "home": {"$ref": "#/$defs/addr"}, "work": {"anyOf": [{"$ref": "#/$defs/addr"}, {"type": "null"}]}}, additionalProperties=False, **{"$defs": {"addr": obj({"city": s(maxLength=30), "zip": s(pattern="^[0-9]{5}$")}, additionalProperties=False)}})),
 ("recursive_tree", "a small tree", {"$ref": "#/$defs/node", "$defs": {"node": obj({"value": i(minimum=0, maximum=100), "children": arr({"$ref": "#/$defs/node"}, maxItems=2)}, ["value"], additionalProperties=False)}}),
 ("sentiment", "a sentiment label", obj({"label": {"enum": ["positive", "negative", "neutral"]}, "score": n(minimum=0, maximum=1)}, additionalProperties=False)),
 ("classification", "a classification", obj({"category": {"enum": ["bug", "feature", "question", "docs"]}, "confidence": {"enum": ["low", "medium", "high"]}}, additionalProperties=False)),
 ("ner_entities", "named entities", obj({"entities": arr(obj({"text": s(maxLength=30), "type": {"enum": ["PERSON", "ORG", "LOC"]}}, additionalProperties=False), maxItems=3)}, additionalProperties=False)),
 ("translation", "a translation", obj({"source_lang": s(pattern="^[a-z]{2}$"), "target_lang": s(pattern="^[a-z]{2}$"), "text": s(maxLength=60)}, additionalProperties=False)),
 ("weather_report", "a weather report", obj({"city": s(maxLength=30), "temperature_c": n(minimum=-90, maximum=60), "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]}, "humidity": i(minimum=0, maximum=100)}, additionalProperties=False)),
 ("recipe", "a recipe", obj({"title": s(maxLength=40), "servings": i(minimum=1, maximum=12), "ingredients": arr(obj({"item": s(maxLength=25), "grams": i(minimum=1, maximum=2000)}, additionalProperties=False), minItems=1, maxItems=3)}, additionalProperties=False)),
 ("movie", "a movie", obj({"title": s(maxLength=40), "year": i(minimum=1888, maximum=2030), "genres": arr({"enum": ["drama", "comedy", "action", "horror", "sci-fi"]}, minItems=1, maxItems=2), "rating": n(minimum=0, maximum=10)}, additionalProperties=False)),
 ("book", "a book", obj({"isbn": s(pattern="^97[89][0-9]{10}$"), "title": s(maxLength=50), "authors": arr(s(maxLength=30), minItems=1, maxItems=2)}, additionalProperties=False)),
 ("log_entry", "a log entry", obj({"timestamp": s(format="date-time"), "level": {"enum": ["DEBUG", "INFO", "WARN", "ERROR"]}, "message": s(maxLength=60)}, additionalProperties=False)),
 ("metric_point", "a metric sample", obj({"metric": s(pattern="^[a-z_]{1,30}$"), "value": n(), "labels": {"type": "object", "additionalProperties": s(maxLength=20), "maxProperties": 2}}, additionalProperties=False)),
 ("feature_flag", "a feature flag", obj({"key": s(pattern="^[a-z][a-z0-9_]{0,30}$"), "enabled": b(), "rollout_percent": i(minimum=0, maximum=100)}, additionalProperties=False)),
 ("oauth_token", "an OAuth token response", obj({"access_token": s(pattern="^[A-Za-z0-9]{16,32}$"), "token_type": {"const": "Bearer"}, "expires_in": i(minimum=60, maximum=86400), "scope": s(maxLength=40)}, additionalProperties=False)),
 ("jwt_claims", "JWT claims", obj({"sub": s(maxLength=30), "iss": s(format="uri", maxLength=50), "exp": i(minimum=0), "admin": b()}, additionalProperties=False)),
 ("user_settings", "user settings", obj({"theme": {"enum": ["light", "dark", "system"]}, "language": s(pattern="^[a-z]{2}(-[A-Z]{2})?$"), "notifications": obj({"email": b(), "push": b()}, additionalProperties=False)}, additionalProperties=False)),
 ("contact_oneof", "a contact method", obj({"method": {"oneOf": [obj({"kind": {"const": "email"}, "address": s(format="email", maxLength=40)}, additionalProperties=False), obj({"kind": {"const": "phone"}, "number": s(pattern="^\\+[0-9]{7,12}$")}, additionalProperties=False)]}}, additionalProperties=False)),
 ("matrix", "a 2x2 matrix", obj({"rows": arr(arr(i(minimum=-9, maximum=9), minItems=2, maxItems=2), minItems=2, maxItems=2)}, additionalProperties=False)),
 ("nullable_fields", "a record with optional fields", obj({"id": i(minimum=1), "nickname": {"type": ["string", "null"], "maxLength": 20}, "age": {"type": ["integer", "null"], "minimum": 0, "maximum": 150}}, additionalProperties=False)),
 ("optional_props", "a search query", obj({"q": s(maxLength=40), "limit": i(minimum=1, maximum=100), "sort": {"enum": ["relevance", "date"]}}, ["q"], additionalProperties=False)),
 ("cron_job", "a scheduled job", obj({"name": s(pattern="^[a-z-]{1,20}$"), "schedule": s(pattern="^[0-9*/,-]+ [0-9*/,-]+ [0-9*/,-]+ [0-9*/,-]+ [0-9*/,-]+$"), "command": s(maxLength=40)}, additionalProperties=False)),
 ("allof_merge", "a timestamped note", {"allOf": [obj({"note": s(maxLength=40)}), obj({"created": s(format="date")})]}),
 ("tuple_prefix_items", "a version triple", obj({"version": {"type": "array", "prefixItems": [i(minimum=0, maximum=99), i(minimum=0, maximum=99), i(minimum=0, maximum=99)], "items": False}}, additionalProperties=False)),
 ("bool_answer", "a yes/no answer", obj({"answer": b(), "reason": s(maxLength=60)}, additionalProperties=False)),
]
assert len({n for n, _, _ in schemas}) == len(schemas)
out = {"about": "Hand-written JSON Schemas modelled on real API payloads (GitHub REST, Kubernetes core/v1 and apps/v1, "
        "OpenAPI 3, Stripe, Slack, GeoJSON, npm, docker-compose, OAuth/JWT, logging, NLP outputs). JSONSchemaBench "
        "cannot be downloaded here (no Hugging Face hub), so this set covers the same features by construction: "
        "nested objects, arrays with bounds, enums, const, patterns, anyOf/oneOf/allOf, $ref and $defs (recursive "
        "too), nullable types, prefixItems and formats (email, uri, date, date-time, uuid, ipv4).",
       "schemas": [{"name": n, "subject": d, "schema": sc} for n, d, sc in schemas]}
json.dump(out, open("tests/fixtures/json_schemas/schemas.json", "w"), indent=1)
print(len(schemas))
